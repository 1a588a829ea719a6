"""Portable paged attention through PyTorch's FlexAttention: one code path for CPU and CUDA.

The block tables become FlexAttention BlockMasks (flex_plan.py), so the kernels visit only the
blocks a sequence owns, GQA without repeating K/V heads (`enable_gqa`).  8-bit caches are
gathered block by block and dequantized to the compute dtype before the call: FlexAttention's
score_mod can scale a score but cannot dequantize the values it multiplies.

Compiled (torch.compile of flex_attention: Triton kernels on CUDA) is the default on CUDA.
On a CPU, torch 2.13's C++ flex kernel fails to build with dynamic shapes (its code generator
renames shape symbols by text: `s31` became `cur_qSplitSize1` in our measurements) and static
shapes recompile at every new batch shape (4-7 s each), so a CPU runs it eagerly: PyTorch's
reference implementation, dense over each batch row's keys, exact but slower than the
reference backend (one thread, a decode layer of 32 sequences x 320 tokens, 9 / 3 heads:
flex eager 28 ms, reference 9.4 ms, C kernel 1.3 ms).  The CPU's fast path remains the C
kernel (cpu-paged); flex on a CPU is for checking the CUDA path's logic on any machine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import flex_attention

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.attention.flex_plan import IN_PLACE, PER_SEQUENCE, SHARED, FlexCall, plan_step
from kvserve.attention.kv_cache import LayerKVCache

logger = logging.getLogger(__name__)


class FlexAttentionBackend(AttentionBackend):
    """Same outputs as TorchRefBackend up to summation order.

    `layout` None picks where keys are read from (flex_plan.py): compiled, the cache in place
    when it holds the compute dtype, else (8-bit) prefills gather each block once and decodes
    gather per sequence (static shapes for a CUDA graph); eager, per sequence.  Tests force
    each layout.

    Decode-only steps are graph-safe (attention/base.py): their plan has static shapes for a
    batch size and block-table width and no host sync (no unique, no nonzero, no .item()),
    and the compiled kernel is compiled during the runner's warm-up runs before capture."""

    graph_safe_decode = True

    def __init__(self, compiled: bool, layout: str | None = None) -> None:
        self.compiled = compiled
        self.layout = layout
        self._attend: Callable[..., torch.Tensor] = (
            torch.compile(flex_attention, dynamic=True) if compiled else eager_flex_attention
        )
        # The step's plans, newest last: two, for models whose layers alternate between a
        # sliding window's metadata and the full one (base.with_window).
        self._cached_plans: list[tuple[AttentionMetadata, tuple[object, ...], object]] = []

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        kv_cache.write(metadata.slot_mapping, key, value)
        plan = self._plan(metadata, kv_cache, query.dtype)
        out = torch.empty_like(query)
        for call in (plan.decode, plan.prefill):
            if call is not None:
                keys, values = kv_source(kv_cache, call, key, value, query.dtype)
                self._run(call, query, keys, values, scale, out)
        return out

    def choose_layout(self, kv_cache: LayerKVCache, dtype: torch.dtype, decode: bool) -> str:
        same_dtype = not kv_cache.quantized and kv_cache.key.dtype == dtype
        if self.layout == IN_PLACE and not same_dtype:
            raise ValueError(
                f"flex attention in place needs a {dtype} cache, not {kv_cache.kv_dtype}"
            )
        if self.layout is not None:
            return self.layout
        if not self.compiled:
            return PER_SEQUENCE
        return IN_PLACE if same_dtype else PER_SEQUENCE if decode else SHARED

    def _plan(self, metadata: AttentionMetadata, kv_cache: LayerKVCache, dtype: torch.dtype):
        """The step's plan, built at the first layer and reused while the model's layers pass
        the same metadata object (or one of the two last: a window's and the full one)."""
        num_blocks, block_size = kv_cache.key.shape[0], kv_cache.key.shape[1]
        layouts = (
            self.choose_layout(kv_cache, dtype, False),
            self.choose_layout(kv_cache, dtype, True),
        )
        key = (num_blocks, block_size, *layouts)
        for cached in self._cached_plans:
            if cached[0] is metadata and cached[1] == key:
                return cached[2]
        plan = plan_step(metadata, num_blocks, block_size, *layouts)
        self._cached_plans = [*self._cached_plans[-1:], (metadata, key, plan)]
        return plan

    def _run(
        self,
        call: FlexCall,
        query: torch.Tensor,  # [T, H, D]
        keys: torch.Tensor,  # [1 or B, Hkv, S, D]
        values: torch.Tensor,
        scale: float,
        out: torch.Tensor,  # [T, H, D], written at the call's rows
    ) -> None:
        padded = torch.cat([query, query.new_zeros(1, *query.shape[1:])])  # row -1: zeros
        q = padded[call.rows].transpose(1, 2).contiguous()  # [B, H, L_max, D]
        options = kernel_options(query.device, call.block_mask.BLOCK_SIZE[1])
        args = (q, keys, values)
        kwargs = dict(block_mask=call.block_mask, scale=scale, enable_gqa=True)
        try:
            o = self._attend(*args, **kwargs, kernel_options=options)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back to eager
            capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
            if not self.compiled or capturing:  # a failed capture is the graph runner's
                raise
            logger.warning(
                "flex attention: torch.compile failed, running it eagerly (%s: %s)",
                type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
            )  # fmt: skip
            self.compiled, self._attend = False, eager_flex_attention
            o = eager_flex_attention(*args, **kwargs)
        o = o.transpose(1, 2).reshape(-1, *o.shape[1::2])  # [B * L_max, H, D]
        out.index_copy_(0, call.out_rows, o.index_select(0, call.out_places).to(out.dtype))


def eager_flex_attention(*args: object, **kwargs: object) -> torch.Tensor:
    """flex_attention's reference implementation, called directly.  Uncompiled, flex_attention
    still traces its operator through torch.compile's eager backend at every new shape; that
    tracing was 60% of the CPU time of tests/unit/test_flex_attention.py (32 s -> 13 s without
    it).  PyTorch's own switch for this is a module flag (its "debug" mode, meant for
    inference-only use like ours); it is set for the call only."""
    previous = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        return flex_attention(*args, **kwargs)  # type: ignore[arg-type]
    finally:
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = previous


def kernel_options(device: torch.device, block_size: int) -> dict[str, int] | None:
    """The Triton kernels tile KV by BLOCK_N rows, which must divide the BlockMask's KV block
    (the cache's block_size: 16 by default, below their default tiles)."""
    if device.type != "cuda":
        return None
    return {"BLOCK_N": min(block_size, 64)}


def kv_source(
    kv_cache: LayerKVCache,
    call: FlexCall,
    key: torch.Tensor,  # [T, kv_heads, head_dim] this step's keys
    value: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [1 or B, kv_heads, slots, head_dim]: the cache itself (call.gather None), or
    the blocks listed in call.gather ([U] or [B, W]) dequantized to `dtype`, with the fresh
    spans' own K/V put back over their rounded copies."""
    if call.gather is None:
        num_blocks, block_size, heads, dim = kv_cache.key.shape
        return tuple(  # type: ignore[return-value]
            t.view(1, num_blocks * block_size, heads, dim).transpose(1, 2)
            for t in (kv_cache.key, kv_cache.value)
        )
    gathered = kv_cache.gather(call.gather, dtype)  # new tensors [(B,) n * bs, heads, dim]
    out = []
    for source, new in zip(gathered, (key, value), strict=True):
        if call.fresh_rows is not None and len(call.fresh_rows):
            flat = source.view(-1, *source.shape[-2:])
            flat.index_copy_(0, call.fresh_slots, new[call.fresh_rows].to(dtype))
        out.append((source if call.gather.dim() == 2 else source[None]).transpose(1, 2))
    return out[0], out[1]
