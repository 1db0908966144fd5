"""The CPU backend: the torch reference, with decode rows through the compiled paged decode kernel.

The kernel (`hearth.ops.cpu_kernels`, float32 queries; a float32 pool, or FP8 with per-head scales) reads keys and values in place from
their pages; until it is built, or for other dtypes, decode rows take the torch path. The choice is
made once per step in `prepare`, so every layer of a step runs the same code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hearth.kv.fp8 import is_fp8
from hearth.ops.attention.backend import AttentionStepInput
from hearth.ops.attention.torch_ref import TorchMetadata, TorchRefBackend
from hearth.ops.cpu_kernels import (
    paged_decode_attention_bf16_kernel,
    paged_decode_attention_fp8_kernel,
    paged_decode_attention_kernel,
)


def _bf16_decode(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The bf16-pool kernel as the float32 one is called: it takes float32 queries and returns float32."""

    def decode(q: torch.Tensor, *args: object) -> torch.Tensor:
        return kernel(q.float(), *args).to(torch.bfloat16)

    return decode


class CpuBackend(TorchRefBackend):
    name = "cpu"

    def _kernel(self) -> Callable[..., object] | None:
        if self.device.type != "cpu":
            return None
        if self.dtype == torch.bfloat16 and self.kv_dtype == torch.bfloat16:
            # A bf16 model (CPUs with bf16 math): without this, decode gathers every row's pages and
            # masks them, over half of a bf16 decode step on Sapphire Rapids (issue 11).
            kernel = paged_decode_attention_bf16_kernel()
            return _bf16_decode(kernel) if kernel is not None else None  # type: ignore[arg-type]
        if self.dtype != torch.float32:
            return None
        if self.kv_dtype == torch.float32:
            return paged_decode_attention_kernel()
        if is_fp8(self.kv_dtype):
            return paged_decode_attention_fp8_kernel()
        return None

    def _uses_decode_kernel(self) -> bool:
        return self._kernel() is not None

    def prepare(self, step_input: AttentionStepInput) -> TorchMetadata:
        md = super().prepare(step_input)
        md.decode_kernel = self._kernel() if md.decode_mask is None else None
        return md

    def _decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        md: TorchMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        kernel = md.decode_kernel
        if kernel is None:
            return super()._decode(q, k_pool, v_pool, md, scale, kv_scales)
        n = md.num_decode_rows
        if kv_scales is not None:
            return kernel(
                q.contiguous(),
                k_pool,
                v_pool,
                kv_scales[0],
                kv_scales[1],
                md.page_table[:n],
                md.seq_lens[:n],
                md.decode_first_positions,
                md.page_size,
                scale,
            )
        # The whole-width rows of the page table buffer: contiguous, and the kernel reads only the
        # pages a row's context covers.
        return kernel(
            q.contiguous(),
            k_pool,
            v_pool,
            md.page_table[: md.num_decode_rows],
            md.seq_lens[: md.num_decode_rows],
            md.decode_first_positions,
            md.page_size,
            scale,
        )
