import pytest
import torch

from hearth.kv.checksum import PageChecksumError, page_checksum, verify_page_checksum
from hearth.parallel.state import ParallelState, all_gather_tp, all_reduce_tp, parallel_state


def test_checksum_of_tensor_equals_checksum_of_its_bytes_and_detects_one_flipped_bit() -> None:
    page = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    raw = bytes(page.view(torch.uint8).numpy().tobytes())
    assert page_checksum(page) == page_checksum(raw)
    verify_page_checksum(raw, page_checksum(page))
    flipped = bytearray(raw)
    flipped[5] ^= 1
    with pytest.raises(PageChecksumError, match="mismatch"):
        verify_page_checksum(bytes(flipped), page_checksum(page))


def test_one_process_collectives_are_identity() -> None:
    assert parallel_state() == ParallelState()
    assert parallel_state().layout_tag == "tp1pp1ep1"
    x = torch.arange(4.0)
    assert all_reduce_tp(x) is x
    assert all_gather_tp(x) is x
