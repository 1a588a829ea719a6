"""Sliding-window attention (AttentionMetadata.sliding_window) in the cpu-paged and flex
backends against the reference's windowed masks: decode-only steps, fresh prompts longer than
the window, chunks over cached context, and mixed steps, at windows smaller than a block, of
one block, and of several, over sequences longer than the window.

Every case runs the backend on metadata whose block-table entries before each sequence's
window name one block filled with NaN (base.py: a window's KV group frees those blocks, their
entries may hold any block id): a backend that reads them as context returns NaN.  The
reference runs on the clean tables (it gathers whole tables, and NaN times a zero weight is
NaN), which its mask makes irrelevant to its output."""

from __future__ import annotations

import pytest
import torch
from attention_cases import (
    decode_tolerance,
    filled_cache,
    garbage_before_window,
    mixed_step,
    poison_block,
)
from torch.nn.attention.flex_attention import flex_attention

from kvserve.attention import select_backend
from kvserve.attention.base import with_window
from kvserve.attention.flex import FlexAttentionBackend
from kvserve.attention.flex_plan import IN_PLACE, PER_SEQUENCE, Q_TILE, SHARED, plan_step
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.native import ops

BLOCK_SIZE = 16
WINDOWS = [5, 16, 37, 100]
HEADS, KV_HEADS, DIM = 4, 2, 32
DECODES = [3, 40, 130, 211]  # tokens cached before each decode's new one
FRESH = [(0, 11), (0, 120)]  # (cached, new): prompts with nothing cached
CHUNKS = [(21, 9), (150, 40), (37, 70), (200, 1)]  # chunks over cached context
STEPS = {
    "decode": (DECODES, []),
    "fresh": ([], FRESH),
    "chunks": ([], CHUNKS),
    "mixed": (DECODES[1:], FRESH[1:] + CHUNKS[:3]),
}


def windowed_case(step: str, window: int, kv_dtype: str, seed: int = 0):
    """(q, k, v, clean metadata, metadata with garbage before the windows, a function that
    builds the step's cache, the garbage block): the cache has one block more than the step
    uses, the garbage one."""
    gen = torch.Generator().manual_seed(seed + window)
    decodes, prefills = STEPS[step]
    md, num_blocks, num_tokens = mixed_step(
        BLOCK_SIZE, gen, prefills=prefills, decode_contexts=decodes
    )
    md = with_window(md, window)
    garbage = num_blocks
    dirty = garbage_before_window(md, BLOCK_SIZE, garbage)
    q, k, v = (torch.randn(num_tokens, n, DIM, generator=gen) for n in (HEADS, KV_HEADS, KV_HEADS))

    def cache(poisoned: bool):
        c = filled_cache(kv_dtype, num_blocks + 1, BLOCK_SIZE, KV_HEADS, DIM, gen.manual_seed(7))
        if poisoned:
            poison_block(c, garbage)
        return c

    return q, k, v, md, dirty, cache, garbage


def _garbage_entries(md, garbage: int) -> int:
    tables = [md.decode_block_tables.flatten()] + [s.block_table for s in md.prefills]
    return int(sum((t == garbage).sum() for t in tables))


def _reference(q, k, v, md, cache):
    out = TorchRefBackend().forward(q, k, v, cache(False), md, DIM**-0.5)
    assert torch.isfinite(out).all()
    return out


@pytest.mark.parametrize("window", WINDOWS)
def test_the_cases_leave_blocks_before_the_windows(window):
    """Every step but the fresh prompts has table entries before some window (the garbage
    that the backends must not read), and the reference ignores them: its output on the
    garbage tables over a cache whose garbage block holds finite values is the same."""
    for step in STEPS:
        q, k, v, md, dirty, cache, garbage = windowed_case(step, window, "float32")
        assert _garbage_entries(dirty, garbage) > 0 or step == "fresh"
        clean_out = _reference(q, k, v, md, cache)
        dirty_out = TorchRefBackend().forward(q, k, v, cache(False), dirty, DIM**-0.5)
        torch.testing.assert_close(dirty_out, clean_out, atol=0, rtol=0)


# --- cpu-paged --------------------------------------------------------------------------------

cpu_kernel = pytest.mark.skipif(not ops.available(), reason="no C compiler here")


@cpu_kernel
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_paged_equals_reference(window, kv_dtype):
    backend = select_backend("cpu-paged", torch.device("cpu"))
    for step in STEPS:
        q, k, v, md, dirty, cache, _ = windowed_case(step, window, kv_dtype)
        expected = _reference(q, k, v, md, cache)
        got = backend.forward(q, k, v, cache(True), dirty, DIM**-0.5)
        torch.testing.assert_close(got, expected, **decode_tolerance(kv_dtype), msg=step)


@cpu_kernel
@pytest.mark.parametrize("window", [5, 37])
def test_cpu_paged_bfloat16_model_equals_reference(window):
    """bf16 queries and cache: the decode kernel's io_bf16 path and the bf16 prefill paths."""
    backend = select_backend("cpu-paged", torch.device("cpu"))
    for step in STEPS:
        q, k, v, md, dirty, cache, _ = windowed_case(step, window, "bfloat16", seed=3)
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        expected = _reference(q, k, v, md, cache)
        got = backend.forward(q, k, v, cache(True), dirty, DIM**-0.5)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2, msg=step)


@cpu_kernel
def test_the_decode_kernel_windows_each_sequence_and_skips_the_blocks_before():
    """The kernel alone, a window per call: each sequence's output equals attention over its
    last `window` keys, and a table entry before the window naming a block past the cache's
    end (not a block at all) is never read."""
    gen = torch.Generator().manual_seed(4)
    cache = filled_cache("float32", 12, 8, 1, 16, gen)
    tables = torch.tensor([[3, 7, 1, 4], [9, 2, 0, 0], [5, 6, 8, 10]])
    lens = torch.tensor([29, 9, 32])
    q = torch.randn(3, 2, 16, generator=gen)
    kernels = ops.kernels()
    for window in (1, 3, 8, 11, 16, 40):
        far = tables.clone()
        for row, n in enumerate(lens.tolist()):
            far[row, : max(0, n - window) // 8] = 1 << 40  # far outside the cache
        out = torch.empty_like(q)
        kernels.paged_decode(q, out, cache, far, lens, 0.25, window=window)
        for row, n in enumerate(lens.tolist()):
            keys, values = cache.gather(tables[row], torch.float32)
            start = max(0, n - window)
            keys, values = keys[start:n].transpose(0, 1), values[start:n].transpose(0, 1)
            scores = (q[row, :, None] @ keys.transpose(1, 2))[:, 0] * 0.25  # [H, S]
            expected = scores.softmax(-1)[:, None] @ values
            torch.testing.assert_close(out[row], expected[:, 0], atol=2e-5, rtol=1e-4)


def test_cpu_paged_declines_the_fused_decode_step_for_windows():
    backend = select_backend("cpu-paged", torch.device("cpu"))
    _, _, _, md, _, cache, _ = windowed_case("decode", 16, "bfloat16")
    plan = backend.plan_decode_step([cache(False)], md, torch.bfloat16, HEADS)
    assert plan is None


# --- flex -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_dtype", "layouts"),
    [("float32", [PER_SEQUENCE, SHARED, IN_PLACE]), ("int8", [PER_SEQUENCE, SHARED])],
)
@pytest.mark.parametrize("window", [5, 37])
def test_flex_equals_reference(window, kv_dtype, layouts):
    """Eager FlexAttention (dense over each batch row's keys) on a mixed step and a
    decode-only one.  In place reads the whole cache, where eager FlexAttention multiplies
    every row by its weight (NaN x 0 is NaN): its garbage block holds large finite values."""
    for step in ("mixed", "decode"):
        q, k, v, md, dirty, cache, garbage = windowed_case(step, window, kv_dtype, seed=1)
        expected = _reference(q, k, v, md, cache)
        for layout in layouts:
            poisoned = cache(layout != IN_PLACE)
            if layout == IN_PLACE:
                poison_block(poisoned, garbage, 1e4)
            got = FlexAttentionBackend(compiled=False, layout=layout).forward(
                q, k, v, poisoned, dirty, DIM**-0.5
            )
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=(step, layout))


def _listed_blocks(num, indices, b, tile) -> set[int]:
    return set(indices[b, 0, tile, : num[b, 0, tile]].tolist())


@pytest.mark.parametrize("layout", [IN_PLACE, PER_SEQUENCE, SHARED])
@pytest.mark.parametrize("window", WINDOWS)
def test_flex_block_lists_hold_exactly_the_window(window, layout):
    """The BlockMask's lists, which the compiled kernels (CUDA's path) visit and eager
    FlexAttention ignores: per query tile, the blocks listed are exactly those its mask
    shows any live row, those listed whole exactly those it shows every live row in full,
    and the garbage block before the windows is in none."""
    gen = torch.Generator().manual_seed(window)
    md, num_blocks, _ = mixed_step(
        BLOCK_SIZE, gen, prefills=[(0, 150), (300, 200), (37, 9)], decode_contexts=DECODES
    )
    dirty = garbage_before_window(with_window(md, window), BLOCK_SIZE, num_blocks)
    plan = plan_step(dirty, num_blocks + 1, BLOCK_SIZE, layout)
    for call in (plan.decode, plan.prefill):
        mask = call.block_mask
        batch, max_len = call.rows.shape
        num_slots = mask.seq_lengths[1]
        b = torch.arange(batch)[:, None, None]
        q_idx = torch.arange(max_len)[None, :, None]
        kv_idx = torch.arange(num_slots)[None, None, :]
        dense = mask.mask_mod(b, 0, q_idx, kv_idx).expand(batch, max_len, num_slots)
        live = call.rows >= 0
        for row in range(batch):
            for tile in range(-(-max_len // Q_TILE)):
                rows = slice(tile * Q_TILE, (tile + 1) * Q_TILE)
                seen = dense[row, rows][live[row, rows]].view(-1, num_slots // BLOCK_SIZE,
                                                             BLOCK_SIZE)  # fmt: skip
                anyone = set(seen.any(2).any(0).nonzero()[:, 0].tolist())
                everyone = set(seen.all(2).all(0).nonzero()[:, 0].tolist()) if len(seen) else set()
                partial = _listed_blocks(mask.kv_num_blocks, mask.kv_indices, row, tile)
                full = _listed_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, row, tile)
                assert full == everyone, (row, tile)
                assert partial | full == anyone and not partial & full, (row, tile)
                if layout == IN_PLACE:
                    assert num_blocks not in partial | full
        if layout == SHARED:
            assert num_blocks not in call.gather.tolist()
        if layout == PER_SEQUENCE:
            assert num_blocks not in call.gather.flatten().tolist()


def test_the_compiled_kernel_attends_the_listed_window_blocks():
    """torch.compile'd FlexAttention (static shapes, which build on a CPU: flex.py) visits
    only the BlockMask's lists and skips the mask on full blocks: a mixed step under a window
    of 37 over a cache whose garbage block, named by the tables before the windows, is NaN
    (a kernel that visited it would return NaN).  Compiles once (~15 s on 2 cores)."""
    q, k, v, md, dirty, cache, _ = windowed_case("mixed", 37, "float32", seed=2)
    expected = _reference(q, k, v, md, cache)
    backend = FlexAttentionBackend(compiled=False, layout=IN_PLACE)
    backend._attend = torch.compile(flex_attention, dynamic=False)
    got = backend.forward(q, k, v, cache(True), dirty, DIM**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
