"""Row-count buckets for oneDNN matmuls (issue 19): a bounded set of shapes, and exact results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hearth.ops import linear as linear_module
from hearth.ops.linear import LinearWeights, prepack_weight
from hearth.ops.row_buckets import EXACT_MAX_ROWS, bucket_rows, padded_linear_pointwise


def test_buckets_are_few_cover_every_count_and_pad_at_most_an_eighth() -> None:
    buckets = {bucket_rows(rows) for rows in range(1, 2049)}
    # Before bucketing every row count was its own oneDNN shape (2048 here); now 16 exact + 8 per octave.
    assert len(buckets) == EXACT_MAX_ROWS + 8 * 7
    for rows in range(1, 5000):
        padded = bucket_rows(rows)
        assert rows <= padded <= max(rows, rows * 1.125), rows
    assert [bucket_rows(n) for n in (1, 16, 17, 20, 21, 100, 400, 1000, 1024, 1025)] == [
        1, 16, 18, 20, 22, 104, 416, 1024, 1024, 1152,
    ]  # fmt: skip


@pytest.mark.parametrize("rows", [1, 3, 17, 37, 130, 700])
def test_padded_matmul_matches_f_linear(rows: int) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 64)
    packed = prepack_weight(weight)
    if packed is None:
        pytest.skip("this torch build has no oneDNN linear")
    x, bias = torch.randn(rows, 64), torch.randn(96)
    out = padded_linear_pointwise(x, packed, bias)
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_linear_sends_packed_rows_through_the_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(32, 16)
    packed = prepack_weight(weight)
    if packed is None:
        pytest.skip("this torch build has no oneDNN linear")
    seen_rows: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    class _Recorder:
        def _linear_pointwise(self, x: torch.Tensor, *args: object) -> torch.Tensor:
            seen_rows.append(x.shape[0])
            return real(x, *args)

    monkeypatch.setattr("hearth.ops.row_buckets.torch.ops.mkldnn", _Recorder(), raising=False)
    weights = LinearWeights(fp32=None, packed=packed)
    for rows in range(17, 65):
        out = linear_module.linear(torch.randn(rows, 16), weights, None)
        assert out.shape == (rows, 32)
    assert set(seen_rows) == {18, 20, 22, 24, 26, 28, 30, 32, 36, 40, 44, 48, 52, 56, 60, 64}
