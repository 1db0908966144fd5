"""The KV integrity check as its own small kernel: every (page, expected tag) of a step against the
pool's current tags, one program per row, separate from attention (so the check never contends with
the attention kernel's thread groups). The torch version is `check_page_tags_reference`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _check_page_tags_kernel(
    page_table_ptr,
    expected_ptr,
    num_pages_ptr,
    pool_tags_ptr,
    failed_ptr,
    stride_pt_row,
    stride_ex_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    num_pages = tl.load(num_pages_ptr + row)
    mismatches = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_pages, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < num_pages
        page = tl.load(page_table_ptr + row * stride_pt_row + offs, mask=valid, other=0)
        expected = tl.load(expected_ptr + row * stride_ex_row + offs, mask=valid, other=0)
        found = tl.load(pool_tags_ptr + page, mask=valid, other=0)
        mismatches += (valid & (found != expected)).to(tl.int32)
    tl.store(failed_ptr + row, tl.sum(mismatches, 0) > 0)


def check_page_tags(
    page_table: torch.Tensor, expected_tags: torch.Tensor, num_pages: torch.Tensor, pool_tags: torch.Tensor
) -> torch.Tensor:
    """bool `[rows]`: row r failed when one of its first `num_pages[r]` pages has a tag other than expected."""
    num_rows = num_pages.shape[0]
    failed = torch.zeros(num_rows, dtype=torch.bool, device=page_table.device)
    if num_rows:
        _check_page_tags_kernel[(num_rows,)](
            page_table,
            expected_tags,
            num_pages,
            pool_tags,
            failed,
            page_table.stride(0),
            expected_tags.stride(0),
            BLOCK=64,
        )
    return failed


def check_page_tags_reference(
    page_table: torch.Tensor, expected_tags: torch.Tensor, num_pages: torch.Tensor, pool_tags: torch.Tensor
) -> torch.Tensor:
    columns = torch.arange(page_table.shape[1], device=page_table.device)
    in_row = columns[None, :] < num_pages[:, None]
    return ((pool_tags[page_table] != expected_tags) & in_row).any(dim=1)
