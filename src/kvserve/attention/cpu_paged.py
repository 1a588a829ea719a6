"""CPU attention backend: decodes read the paged K/V in place through a C kernel.

Profiling the reference backend on W1 showed about half of a server's time in decode
attention (docs/decisions/paged-decode-kernel.md): copying each sequence's blocks into a
padded tensor every layer and step, then attending over the copy.  This backend hands the
decode rows to `native/csrc/attention/paged_decode.c`, which walks the block tables and reads
each cached row once (8-bit rows dequantized on the fly).
Prefills keep the reference path: their gathered context is shared by many query tokens, and
SDPA's blocked kernels are faster there.

Sliding windows (AttentionMetadata.sliding_window): the decode kernel starts each sequence at
its window's first key, never reading the table entries before it (any block id); a prefill
that the window cuts gathers its blocks from its first query's window on and attends them
through SDPA with a banded mask (`_windowed_prefill`: the bf16 prefill kernel has no window);
the one-call decode step declines windowed steps (`plan_decode_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from kvserve import kv_quant as quant
from kvserve.attention import bf16_prefill, shared_prefix
from kvserve.attention.base import AttentionMetadata, DecodeStepPlan, PrefillSpan
from kvserve.attention.kv_cache import LayerKVCache, as_int64
from kvserve.attention.torch_ref import (
    TorchRefBackend,
    _sequence_attention,
    trailing_causal_mask,
)
from kvserve.native import ops


def sharing_rows(
    md: AttentionMetadata, inside: list[PrefillSpan]
) -> tuple[torch.Tensor, AttentionMetadata]:
    """The query rows of the sequences that share the prefix (every decode and each prefill
    chunk not in `inside`), and their metadata as a batch of those rows alone."""
    spans, pieces, start = [], [torch.arange(md.num_decode_tokens)], md.num_decode_tokens
    skipped = {id(span) for span in inside}
    for span in md.prefills:
        if id(span) in skipped:
            continue
        pieces.append(torch.arange(span.query_start, span.query_end))
        spans.append(replace(span, query_start=start, query_end=start + span.num_query))
        start += span.num_query
    return torch.cat(pieces), replace(md, prefills=tuple(spans))


def same_shape_groups(spans: tuple[PrefillSpan, ...]) -> list[list[PrefillSpan]]:
    """Prefill spans grouped by (query tokens, context length), in order of first appearance:
    past a shared prefix, each group's suffixes are attended in one batched call (W3's 63
    suffixes of 32 tokens over 1,056 are one group)."""
    groups: dict[tuple[int, int], list[PrefillSpan]] = {}
    for span in spans:
        groups.setdefault((span.num_query, span.seq_len), []).append(span)
    return list(groups.values())


def _rows_of(spans: list[PrefillSpan]) -> slice | torch.Tensor:
    """The batch rows of the spans' query tokens, in order: a slice when each span starts
    where the one before it ends."""
    if all(a.query_end == b.query_start for a, b in zip(spans, spans[1:], strict=False)):
        return slice(spans[0].query_start, spans[-1].query_end)
    return torch.cat([torch.arange(s.query_start, s.query_end) for s in spans])


# Query x key pairs of a chunk after context under which, where the cache does not keep K/V
# as computed, the reference's one masked call over the gathered whole beats two flash calls
# and a merge (docs/decisions/prefill-split-stored.md): float32 queries, one layer, 2 threads,
# 256 after 1,024 keys 1.01x the masked call's time, 512 after 512 0.92x, 2,048 after 6,144
# 0.70x.
MIN_SPLIT_PAIRS_STORED = 1 << 19


def _cache_keeps_as_computed(
    key: torch.Tensor, value: torch.Tensor, kv_cache: LayerKVCache
) -> bool:
    """The cache stores this step's K/V exactly as computed: unquantized, of their dtype, on
    the CPU."""
    return (
        not kv_cache.quantized
        and key.device.type == "cpu"
        and key.dtype == value.dtype == kv_cache.key.dtype
    )


def _kernel_can_store(key: torch.Tensor, value: torch.Tensor, kv_cache: LayerKVCache) -> bool:
    """The decode kernel can store this step's K/V itself: the cache keeps them as computed,
    and each token's heads x dim values are contiguous (K after RoPE is its own tensor, V a
    view of the QKV projection: their rows are spaced differently, which the kernel takes)."""
    return _cache_keeps_as_computed(key, value, kv_cache) and all(
        x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (key, value)
    )


def _attends_prefix_once(
    metadata: AttentionMetadata, prefix_len: int, inside: Sequence[PrefillSpan]
) -> bool:
    """The step's shared prefix is long enough, and shared by enough of its sequences (those
    with no chunk starting `inside` it), to be attended once for all of them."""
    num_sharing = metadata.num_decode_tokens + len(metadata.prefills) - len(inside)
    return (
        prefix_len >= shared_prefix.MIN_SHARED_TOKENS and num_sharing >= shared_prefix.MIN_SEQUENCES
    )


class CpuPagedBackend(TorchRefBackend):
    """Same outputs as TorchRefBackend (up to float32 summation order), faster decodes on CPU.
    Tensors on another device go through the reference path."""

    def __init__(self) -> None:
        self._kernels = ops.kernels()
        self._bf16_prefill = bf16_prefill.prefill_kernel_available()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The reference's contract; a step whose sequences share a long prefix attends it
        once for all of them (shared_prefix.py)."""
        prefix_len = metadata.shared_prefix_blocks * kv_cache.key.shape[1]
        inside = [s for s in metadata.prefills if s.seq_len - s.num_query < prefix_len]
        if (
            query.device.type != "cpu"
            or metadata.sliding_window  # windowed metadata has no shared prefix (with_window)
            or not _attends_prefix_once(metadata, prefix_len, inside)
        ):
            if not metadata.prefills and _kernel_can_store(key, value, kv_cache):
                store = ops.NewRows(key, value, as_int64(metadata.slot_mapping))
                return self._decode(query, kv_cache, metadata, scale, store)
            return super().forward(query, key, value, kv_cache, metadata, scale)
        if not metadata.prefills and _kernel_can_store(key, value, kv_cache):
            # Decodes only, all past the prefix: the kernel stores their rows as it attends
            # them (W3's decode steps: a separate write cost ~60 us a layer).
            store = ops.NewRows(key, value, as_int64(metadata.slot_mapping))
            return self._split_at_shared_prefix(query, kv_cache, metadata, scale, store)
        kv_cache.write(metadata.slot_mapping, key, value)
        if not inside:
            return self._split_at_shared_prefix(query, kv_cache, metadata, scale)
        # Chunks that start inside the prefix (the one computing it this step) attend as
        # usual; the others share it, as a batch of their own rows.
        out = torch.empty_like(query)
        self._prefills(query, key, value, kv_cache, inside, scale, out)
        rows, sharing = sharing_rows(metadata, inside)
        out[rows] = self._split_at_shared_prefix(query[rows], kv_cache, sharing, scale)
        return out

    def plan_decode_step(
        self,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
        dtype: torch.dtype,  # the queries'
        num_heads: int,  # query heads
    ) -> DecodeStepPlan | None:
        """The step's attention for a one-call decode step, where `forward` would take the
        decode kernel in every layer with the arguments built here (no prefill; caches of the
        model's dtype, or 8-bit ones, on the CPU; the new rows stored as `forward` stores
        them), after the paged prefill kernel for a shared prefix attended once
        (`_split_at_shared_prefix`'s decode-only case, bf16 caches); else None: the layers
        call `forward`."""
        first = kv_caches[0] if kv_caches else None
        if (
            first is None
            # A sliding window: the fused step (layer/decode_layer.c, AVX512-BF16/AMX CPUs
            # alone) passes no window to the decode kernel, and its steps could not be tested
            # on the CPUs this was written on, so windowed layers call `forward`.
            or metadata.sliding_window
            # A 4-bit cache: rows are rotated around each layer's `forward` (rotation.py), and
            # the one-call step (layer/decode_layer.c) neither rotates nor stores 4-bit codes.
            or first.rotated
            or first.kv_dtype in quant.PACKED_DTYPES
            # bf16 queries and outputs (decode_layer.c), or float32 ones (decode_step_q8.c)
            or dtype not in (torch.bfloat16, torch.float32)
            or metadata.prefills
            or first.key.device.type != "cpu"
            or any(c.kv_dtype != first.kv_dtype for c in kv_caches)
            or not (first.quantized or first.key.dtype == dtype)
        ):
            return None
        block_size = first.key.shape[1]
        prefix_len = metadata.shared_prefix_blocks * block_size
        plan = DecodeStepPlan(
            kv_caches=tuple(kv_caches),
            tables=as_int64(metadata.decode_block_tables),
            seq_lens=as_int64(metadata.decode_seq_lens),
            slots=as_int64(metadata.slot_mapping),
            block_size=block_size,
        )
        if not _attends_prefix_once(metadata, prefix_len, ()):
            return plan
        if not self._bf16_prefill or block_size % 16 or first.quantized or dtype != torch.bfloat16:
            return None  # forward gathers the prefix for SDPA: the layers call it
        rows, dim = metadata.num_decode_tokens, first.key.shape[3]
        return replace(
            plan,
            seq_lens=plan.seq_lens - prefix_len,
            prefix_blocks=metadata.shared_prefix_blocks,
            prefix_table=plan.tables[0, : metadata.shared_prefix_blocks].contiguous(),
            prior_out=torch.empty((rows, num_heads, dim), dtype=torch.float32),
            prior_lse=torch.empty((rows, num_heads), dtype=torch.float32),
        )

    def _prefills(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        spans: Sequence[PrefillSpan],
        scale: float,
        out: torch.Tensor,
        window: int = 0,
    ) -> None:
        """The reference's chunks, with fresh prompts of one length that follow each other in
        the batch attended in one kernel call: W1's steps of 8 prompts of 256 tokens made 8
        calls a layer, ~0.25 ms more than one.  (The kernel's mask is causal: not for prompts
        longer than a sliding window.)"""
        for group in same_shape_groups(tuple(spans)):
            windowed = 0 < window < group[0].seq_len
            if windowed or not self._fresh_prompts(query, key, value, out, group, scale):
                super()._prefills(query, key, value, kv_cache, group, scale, out, window)

    def _fresh_prompts(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        spans: list[PrefillSpan],  # of one shape
        scale: float,
    ) -> bool:
        """Attend several whole prompts of one length, adjacent in the batch, in one bf16
        kernel call into `out`; False (nothing done) where that does not apply."""
        rows = _rows_of(spans)
        if (
            len(spans) < 2
            or spans[0].seq_len != spans[0].num_query
            or not isinstance(rows, slice)
            or not self._bf16_prefill
            or query.dtype != torch.bfloat16
        ):
            return False
        n, length = len(spans), spans[0].num_query
        q, k, v = (x[rows].view(n, length, *x.shape[1:]) for x in (query, key, value))
        result = bf16_prefill.attend_batch(q, k, v, True, scale)
        if result is None:
            return False
        out[rows] = result[0].flatten(0, 1)
        return True

    def _split_at_shared_prefix(
        self,
        query: torch.Tensor,
        kv_cache: LayerKVCache,
        md: AttentionMetadata,
        scale: float,
        store: ops.NewRows | None = None,  # a decode-only step's new rows, stored by the kernel
    ) -> torch.Tensor:
        num_blocks = md.shared_prefix_blocks
        prefix_len = num_blocks * kv_cache.key.shape[1]
        first = md.decode_block_tables[0] if md.num_decode_tokens else md.prefills[0].block_table
        paged = self._paged_kernel(query[None], kv_cache, first[None, :num_blocks], prefix_len,
                                   False, scale, True)  # fmt: skip
        if paged is not None:
            out1, lse1 = paged[0][0], paged[1][0]  # type: ignore[index]
        else:
            keys, values = kv_cache.gather(first[:num_blocks], query.dtype)
            out1, lse1 = shared_prefix.attention_with_lse(query, keys, values, None, scale)
        d = md.num_decode_tokens
        tables = md.decode_block_tables[:, num_blocks:]
        lens = md.decode_seq_lens - prefix_len
        if d and not md.prefills:  # the kernel merges the prefix's part into each decode's
            prior = (out1.float().contiguous(), lse1.contiguous())
            out = self._kernel_decode(query, kv_cache, tables, lens, scale, None, store, prior)
            return out.to(query.dtype)
        out2 = torch.empty(query.shape, dtype=torch.float32)
        lse2 = torch.empty(query.shape[:2], dtype=torch.float32)
        if d:
            out2[:d] = self._kernel_decode(
                query[:d], kv_cache, tables, lens, scale, lse2[:d], store
            )
        for spans in same_shape_groups(md.prefills):
            rows, out, lse = self._suffix_attention(query, kv_cache, spans, num_blocks, scale)
            out2[rows] = out if isinstance(rows, slice) else out.to(out2.dtype)
            lse2[rows] = lse
        return shared_prefix.merge(out1, lse1, out2, lse2).to(query.dtype)

    def _suffix_attention(
        self,
        query: torch.Tensor,  # [T, H, D]
        kv_cache: LayerKVCache,
        spans: list[PrefillSpan],  # of one shape (same_shape_groups)
        num_blocks: int,  # the shared prefix's
        scale: float,
    ) -> tuple[slice | torch.Tensor, torch.Tensor, torch.Tensor]:
        """The spans' queries over their own blocks past the shared prefix, in one call:
        (their rows in the batch: a slice when the spans follow each other, as W3's 63
        suffixes do, else an index [n]; outputs [n, H, D], log-sum-exps [n, H]).  A slice
        reads and writes the rows in place, where gathering and scattering 2,016 x 9 x 64
        values cost ~0.8 ms a layer."""
        block_size = kv_cache.key.shape[1]
        suffix_len = spans[0].seq_len - num_blocks * block_size
        num_query, own_blocks = spans[0].num_query, -(-suffix_len // block_size)
        tables = torch.stack([s.block_table[num_blocks : num_blocks + own_blocks] for s in spans])
        rows = _rows_of(spans)
        q = query[rows].view(len(spans), num_query, *query.shape[1:])
        # Each suffix's chunk ends it: the kernel's causal case.  30 x 32 tokens over their
        # 32 keys took SDPA's masked flash call ~1.8 ms a layer on an AVX512-BF16 CPU
        # without AMX.
        result = self._paged_kernel(q, kv_cache, tables, suffix_len, True, scale, True)
        if result is not None:
            out, lse = result
            return rows, out.flatten(0, 1), lse.flatten(0, 1)  # type: ignore[union-attr]
        keys, values = kv_cache.gather(tables, query.dtype)  # [N, blocks x size, Hkv, D]
        keys, values = keys[:, :suffix_len], values[:, :suffix_len]
        kernel = self._bf16_prefill and q.dtype == torch.bfloat16
        result = bf16_prefill.attend_batch(q, keys, values, True, scale, True) if kernel else None
        if result is not None:
            out, lse = result
            return rows, out.flatten(0, 1), lse.flatten(0, 1)  # type: ignore[union-attr]
        mask = trailing_causal_mask(suffix_len, num_query, query.device)
        out, lse = shared_prefix.batched_attention_with_lse(q, keys, values, mask, scale)
        return rows, out.flatten(0, 1), lse.flatten(0, 1)

    def _prefill(
        self,
        query: torch.Tensor,  # [L, H, D]
        key: torch.Tensor,  # [L, Hkv, D] this step's keys
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        span: PrefillSpan,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """A chunk after cached context attends the context (unmasked) and itself (causal)
        in two flash calls, merged by their log-sum-exps, instead of one masked call over the
        gathered whole: the masked kernel cost 0.72 ms a layer for W1's chunk that continues
        a prompt, and 400 ms against 300 ms for 2,048 float32 queries after 6,144 keys.  Its
        own K/V come as computed where the cache keeps them so, else as the cache holds them
        (gathered with the context: what the reference attends).  A sliding window that
        leaves out some of the sequence's keys takes `_windowed_prefill`."""
        if 0 < window < span.seq_len:
            return self._windowed_prefill(query, key, value, kv_cache, span, scale, window)
        num_context = span.seq_len - query.shape[0]
        if self._bf16_prefill and query.dtype == torch.bfloat16:
            out = self._kernel_prefill(query, key, value, kv_cache, span, scale)
            if out is not None:
                return out
        as_computed = _cache_keeps_as_computed(key, value, kv_cache)
        small = query.shape[0] * span.seq_len < MIN_SPLIT_PAIRS_STORED
        if num_context == 0 or (small and not as_computed):
            return super()._prefill(query, key, value, kv_cache, span, scale)
        gathered = num_context if as_computed else span.seq_len
        block_size = kv_cache.key.shape[1]
        keys, values = kv_cache.gather(span.block_table[: -(-gathered // block_size)], query.dtype)
        if not as_computed:
            key, value = keys[num_context : span.seq_len], values[num_context : span.seq_len]
        out1, lse1 = shared_prefix.attention_with_lse(
            query, keys[:num_context], values[:num_context], None, scale
        )
        out2, lse2 = shared_prefix.causal_attention_with_lse(query, key, value, scale)
        return shared_prefix.merge(out1, lse1, out2, lse2).to(query.dtype)

    def _windowed_prefill(
        self,
        query: torch.Tensor,  # [L, H, D]
        key: torch.Tensor,  # [L, Hkv, D] this step's keys
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        span: PrefillSpan,
        scale: float,
        window: int,  # 0 < window < span.seq_len
    ) -> torch.Tensor:
        """A chunk under a sliding window, as the reference attends it (a fresh prompt over
        its own K/V as computed, a chunk after context over the cache's rows), but gathering
        only the blocks from the one holding its first query's first key: the table's entries
        before it may hold any block id (base.AttentionMetadata.sliding_window).  SDPA with a
        banded mask: the bf16 prefill kernel has no window."""
        num_query = query.shape[0]
        num_context = span.seq_len - num_query
        if num_context == 0:
            keys, values, offset = key, value, 0
        else:
            block_size = kv_cache.key.shape[1]
            first_block = max(0, num_context - window + 1) // block_size
            offset = first_block * block_size
            table = span.block_table[first_block : -(-span.seq_len // block_size)]
            keys, values = kv_cache.gather(table, query.dtype)
            keys, values = keys[: span.seq_len - offset], values[: span.seq_len - offset]
        mask = trailing_causal_mask(span.seq_len, num_query, query.device, window)[:, offset:]
        return _sequence_attention(query, keys, values, mask, scale)

    def _kernel_prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        span: PrefillSpan,
        scale: float,
    ) -> torch.Tensor | None:
        """A bfloat16 chunk through the C kernel (bf16_prefill.py), in one call: a fresh
        prompt over its own K/V, a chunk after context over its whole sequence as the cache
        holds it (the step's rows were stored before attention, so this is what the
        reference attends, quantized or not).  None where the kernel does not apply."""
        if span.seq_len == query.shape[0]:
            keys, values = key, value
        else:
            table = span.block_table[None]
            paged = self._paged_kernel(query[None], kv_cache, table, span.seq_len, True, scale)
            if paged is not None:
                return paged[0][0]
            keys, values = kv_cache.gather(span.block_table, query.dtype)
            keys, values = keys[: span.seq_len], values[: span.seq_len]
        result = bf16_prefill.attend(query, keys, values, True, scale)
        return None if result is None else result[0]

    def _paged_kernel(
        self,
        query: torch.Tensor,  # [N, L, H, D]
        kv_cache: LayerKVCache,
        tables: torch.Tensor,  # [N, blocks]: the blocks of each sequence's first num_keys keys
        num_keys: int,
        causal: bool,
        scale: float,
        with_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """bf16_prefill.attend_paged (the keys read from the cache's blocks in place, no
        gather) where it serves: bf16 queries over an unquantized bf16 cache, blocks of a
        multiple of 16 tokens; else None."""
        if not (
            self._bf16_prefill
            and query.dtype == torch.bfloat16
            and kv_cache.key.dtype == torch.bfloat16
            and not kv_cache.quantized
        ):
            return None
        tables = as_int64(tables)
        return bf16_prefill.attend_paged(
            query, kv_cache.key, kv_cache.value, tables, num_keys, causal, scale, with_lse
        )

    def _decode(
        self,
        query: torch.Tensor,  # [B, H, D]
        kv_cache: LayerKVCache,
        md: AttentionMetadata,
        scale: float,
        store: ops.NewRows | None = None,
    ) -> torch.Tensor:
        """The decodes through the C kernel.  With `store`, a decode-only step is one kernel
        call: each sequence's new K/V row is stored by the thread that then attends it (a
        separate store pass cost ~3.4 ms of a 128-row decode step, most of it misses on the
        256 cold lines it wrote)."""
        if query.device.type != "cpu":
            return super()._decode(query, kv_cache, md, scale)
        out = self._kernel_decode(
            query, kv_cache, md.decode_block_tables, md.decode_seq_lens, scale, None, store,
            window=md.sliding_window,
        )  # fmt: skip
        return out if out.dtype is query.dtype else out.to(query.dtype)

    def _kernel_decode(
        self,
        query: torch.Tensor,  # [B, H, D]
        kv_cache: LayerKVCache,
        block_tables: torch.Tensor,  # [B, max_blocks]
        seq_lens: torch.Tensor,  # [B]
        scale: float,
        lse: torch.Tensor | None,  # [B, H] float32, contiguous: filled when given
        store: ops.NewRows | None = None,  # rows the kernel stores before attending
        prior: tuple[torch.Tensor, torch.Tensor] | None = None,  # merged in (see the kernel)
        window: int = 0,  # a sliding window (AttentionMetadata.sliding_window)
    ) -> torch.Tensor:  # [B, H, D]: bfloat16 for bfloat16 queries without lse, else float32
        # A bf16 model's plain decode: the kernel widens q and rounds its output itself.
        io_bf16 = query.dtype == torch.bfloat16 and lse is None
        q = query if io_bf16 or query.dtype is torch.float32 else query.to(torch.float32)
        q = q.contiguous()
        out = torch.empty_like(q)
        tables, lens = as_int64(block_tables), as_int64(seq_lens)
        self._kernels.paged_decode(q, out, kv_cache, tables, lens, scale, lse, store, prior, window)
        return out
