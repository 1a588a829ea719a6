"""Block tables -> FlexAttention BlockMasks: the per-step plan of the flex backend (flex.py).

A paged cache already is a block-sparse pattern: a sequence's block table lists the blocks its
keys live in.  So the table itself becomes the BlockMask's KV block lists, with the BlockMask's
KV block size equal to the cache's `block_size`, and the kernels visit only those blocks.

Where the keys are read from (the call's *layout*):

* `in-place`: the cache's own tensor viewed as [1, kv_heads, num_slots, head_dim], block ids
  as they are (no copy; the cache must hold the compute dtype);
* `shared`: the distinct blocks the call reads, each gathered once (a prefix shared by many
  sequences once), dequantized, block ids renumbered into that compact tensor;
* `per-sequence`: each sequence's blocks gathered into its own row [B, kv_heads, W * bs, D],
  as the reference backend does.  Eager FlexAttention is dense over the whole key length of
  a batch row, so this is the layout that keeps its cost at the reference's.

One mask function serves every layout and is exact on its own (the eager implementation
evaluates it on the dense score matrix; the compiled kernels only on partial blocks): slot
`kv` is visible to row `q` of sequence `b` when its block belongs to `b` and its position in
`b` is at most the row's position (and, with a sliding window W, more than the row's position
minus W).  Rows past a sequence's query length are padding and see nothing.

Sliding windows (AttentionMetadata.sliding_window): a sequence's table entries for the blocks
wholly before its first query row's window may hold any block id, so none of the layouts reads
them: the paged layouts leave them out of the block map (and the shared layout out of what it
gathers), the per-sequence layout gathers each row's blocks from its window's first block on.
The BlockMask lists, per query tile, the blocks of the window alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.nn.attention.flex_attention import BlockMask

from kvserve.attention.base import AttentionMetadata

IN_PLACE, SHARED, PER_SEQUENCE = "in-place", "shared", "per-sequence"
LAYOUTS = (IN_PLACE, SHARED, PER_SEQUENCE)
Q_TILE = 128  # query rows per BlockMask tile (FlexAttention's default sparse block size)


@dataclass(frozen=True)
class FlexCall:
    """One flex_attention call: its BlockMask, its query rows and where its keys come from."""

    block_mask: BlockMask
    rows: torch.Tensor  # [B, L_max] flat query row of each padded row; -1 for padding
    gather: torch.Tensor | None  # None: in place; [U]: shared blocks; [B, W]: per sequence
    # The real rows once more, found once per step (a boolean mask per layer would make a
    # GPU wait for its count): flat row ids, and their places in the flattened [B * L_max].
    out_rows: torch.Tensor  # [N]
    out_places: torch.Tensor  # [N]
    # Spans with nothing cached attend over their own fresh K/V, as the reference does (for an
    # 8-bit cache: before quantization): flat query rows and their slots in the gathered keys.
    fresh_rows: torch.Tensor | None = None  # [N]
    fresh_slots: torch.Tensor | None = None  # [N] index into the gathered keys' flat rows


@dataclass(frozen=True)
class FlexPlan:
    """A step's calls (decodes, then the prefill spans), the same in every layer."""

    decode: FlexCall | None
    prefill: FlexCall | None


@dataclass(frozen=True)
class _Group:
    """The sequences of one call, as tensors."""

    tables: torch.Tensor  # [B, W] block ids, padded with 0
    seq_lens: torch.Tensor  # [B] context length after this step
    query_lens: torch.Tensor  # [B] query rows this step
    starts: torch.Tensor  # [B] flat index of each sequence's first query row
    max_query_len: int  # known on the host: no device sync (a CUDA graph records decodes)
    window: int = 0  # a sliding window's width (0: full attention)

    def first_columns(self, block_size: int) -> torch.Tensor:
        """[B]: each sequence's first table column that holds keys its rows may see (the
        block of its first query row's window's first key; 0 without a window)."""
        if not self.window:
            return torch.zeros_like(self.seq_lens)
        first_key = (self.seq_lens - self.query_lens - self.window + 1).clamp(min=0)
        return first_key // block_size


def plan_step(
    metadata: AttentionMetadata,
    num_blocks: int,
    block_size: int,
    layout: str,
    decode_layout: str | None = None,
) -> FlexPlan:
    """Decodes are one call with one query row per sequence (in `decode_layout`, default
    `layout`); the prefill spans one call, padded to the longest span.  The decode call is
    built without a host sync or a value-dependent shape in the in-place and per-sequence
    layouts, so a CUDA graph can record it."""
    decode = prefill = None
    window = metadata.sliding_window
    if metadata.num_decode_tokens:
        group = replace(_decode_group(metadata), window=window)
        decode = plan_call(group, num_blocks, block_size, decode_layout or layout)
    if metadata.prefills:
        group = replace(_prefill_group(metadata), window=window)
        prefill = plan_call(group, num_blocks, block_size, layout, fresh_spans=True)
    return FlexPlan(decode, prefill)


def _decode_group(md: AttentionMetadata) -> _Group:
    n = md.num_decode_tokens
    device = md.decode_seq_lens.device
    ones = torch.ones(n, dtype=torch.long, device=device)
    return _Group(
        md.decode_block_tables.to(torch.long),
        md.decode_seq_lens.to(torch.long),
        ones,
        torch.arange(n, device=device),
        1,
    )


def _prefill_group(md: AttentionMetadata) -> _Group:
    spans = md.prefills
    device = md.slot_mapping.device
    width = max(len(s.block_table) for s in spans)
    tables = torch.zeros(len(spans), width, dtype=torch.long, device=device)
    for row, span in enumerate(spans):
        tables[row, : len(span.block_table)] = span.block_table
    return _Group(
        tables,
        torch.tensor([s.seq_len for s in spans], device=device),
        torch.tensor([s.query_end - s.query_start for s in spans], device=device),
        torch.tensor([s.query_start for s in spans], device=device),
        max(s.query_end - s.query_start for s in spans),
    )


def plan_call(
    group: _Group, num_blocks: int, block_size: int, layout: str, fresh_spans: bool = False
) -> FlexCall:
    """`fresh_spans`: prefill spans with nothing cached read their own unrounded K/V (decode
    rows always read the cache, as the reference's do)."""
    if layout == IN_PLACE:
        gather, tables, num_source_blocks = None, group.tables, num_blocks
    elif layout == SHARED:
        gather, tables = _compact(group, block_size)
        num_source_blocks = len(gather)
    elif layout == PER_SEQUENCE:
        batch, width = group.tables.shape
        columns = torch.arange(width, device=group.tables.device).expand(batch, width)
        if group.window:
            # Row b's gathered blocks start at its window's first block (shift_b): table
            # column c is gathered block c - shift_b; columns past its own blocks read block 0.
            shift = group.first_columns(block_size)[:, None]
            source = (columns + shift).clamp(max=width - 1)
            valid = _valid_columns(group, block_size).gather(1, source) & (columns + shift < width)
            gather = torch.where(valid, group.tables.gather(1, source), 0)
            tables = (columns - shift).clamp(min=0)
        else:
            gather, tables = group.tables, columns
        num_source_blocks = width
    else:
        raise ValueError(f"unknown flex layout {layout!r}; one of {', '.join(LAYOUTS)}")
    rows = _rows(group)
    if group.max_query_len == 1:  # decodes: every row is real
        places = torch.arange(rows.shape[0], device=rows.device)
    else:
        places = (rows.reshape(-1) >= 0).nonzero()[:, 0]
    outputs = (rows.reshape(-1)[places], places)
    block_mask = _block_mask(group, tables, num_source_blocks, block_size, layout)
    if gather is None or not fresh_spans:
        return FlexCall(block_mask, rows, gather, *outputs)  # in place: they are in the cache
    fresh_rows, fresh_slots = _fresh_slots(group, rows, tables, block_size, layout)
    return FlexCall(block_mask, rows, gather, *outputs, fresh_rows, fresh_slots)


def _fresh_slots(
    group: _Group, rows: torch.Tensor, tables: torch.Tensor, block_size: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the sequences with no cached context (positions 0..L-1), and where their keys
    sit in the gathered tensor: [1, U * bs] shared, [B, W * bs] per sequence, flattened."""
    fresh = (rows >= 0) & (group.seq_lens == group.query_lens)[:, None]  # [B, L_max]
    batch_index, position = fresh.nonzero(as_tuple=True)
    slots = tables[batch_index, position // block_size] * block_size + position % block_size
    if layout == PER_SEQUENCE:
        slots = slots + batch_index * tables.shape[1] * block_size
    return rows[fresh], slots


def _rows(group: _Group) -> torch.Tensor:
    offsets = torch.arange(group.max_query_len, device=group.tables.device)
    is_row = offsets[None, :] < group.query_lens[:, None]
    return torch.where(is_row, group.starts[:, None] + offsets[None, :], -1)


def _compact(group: _Group, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct blocks the tables name (sorted), and the tables renumbered into them."""
    tables = group.tables
    valid = _valid_columns(group, block_size)
    block_ids, inverse = torch.unique(tables[valid], return_inverse=True)
    renumbered = torch.zeros_like(tables)
    renumbered[valid] = inverse
    return block_ids, renumbered


def _valid_columns(group: _Group, block_size: int, width: int | None = None) -> torch.Tensor:
    """[B, width] bool (width: the tables', or theirs padded): which table entries hold blocks
    the sequence's rows may see (the rest is padding, or blocks wholly before a sliding
    window: any block id)."""
    num_used = (group.seq_lens + block_size - 1) // block_size
    width = group.tables.shape[1] if width is None else width
    columns = torch.arange(width, device=group.tables.device)[None, :]
    valid = columns < num_used[:, None]
    if group.window:
        valid &= columns >= group.first_columns(block_size)[:, None]
    return valid


def _block_mask(
    group: _Group, tables: torch.Tensor, num_source_blocks: int, block_size: int, layout: str
) -> BlockMask:
    """Per query tile: table[full_lo:full_hi] are seen whole by every row (no mask
    evaluated), and table[lo:full_lo] and table[full_hi:hi] in part (the mask decides); without
    a window, lo = full_lo = 0.  Lists are [B, 1, tiles, W]: one head row, broadcast to all
    heads."""
    max_len = group.max_query_len
    lo, full_lo, full_hi, hi = _tile_block_ranges(group, max_len, block_size)
    if tables.device.type == "cpu" and tables.shape[1] < num_source_blocks:
        # Inductor's C++ kernel asserts that the lists could name every KV block.
        tables = torch.nn.functional.pad(tables, (0, num_source_blocks - tables.shape[1]))
    batch, width = tables.shape
    num_tiles = lo.shape[1]
    tiles = tables[:, None, :].expand(batch, num_tiles, width)
    j = torch.arange(width, device=tables.device)
    before = (full_lo - lo)[:, :, None]  # partial blocks before the full ones (a window's)
    partial_columns = torch.where(j < before, lo[:, :, None] + j, full_hi[:, :, None] + j - before)
    partial = torch.gather(tiles, 2, partial_columns.clamp(max=width - 1))
    if group.window:
        full = torch.gather(tiles, 2, (full_lo[:, :, None] + j).clamp(max=width - 1))
    else:
        full = tiles
    return BlockMask.from_kv_blocks(
        (full_lo - lo + hi - full_hi).to(torch.int32)[:, None],
        partial.to(torch.int32)[:, None],
        (full_hi - full_lo).to(torch.int32)[:, None],
        full.to(torch.int32)[:, None].contiguous(),
        BLOCK_SIZE=(Q_TILE, block_size),
        mask_mod=_mask_mod(group, tables, num_source_blocks, block_size, layout),
        seq_lengths=(max_len, num_source_blocks * block_size),
        compute_q_blocks=False,  # the backward pass's transposed lists: inference needs none
    )


def _mask_mod(
    group: _Group, tables: torch.Tensor, num_source_blocks: int, block_size: int, layout: str
) -> Callable[..., torch.Tensor]:
    max_len = group.max_query_len
    offsets = torch.arange(max_len, device=tables.device)[None, :]
    context = (group.seq_lens - group.query_lens)[:, None]
    positions = torch.where(offsets < group.query_lens[:, None], context + offsets, -1)
    if layout == PER_SEQUENCE:
        # Row b holds sequence b's keys in order: a key's slot is its position (less the
        # blocks before its window's first).  (Half the indexing of the paged mask, which
        # eager FlexAttention evaluates on every score.)
        if not group.window:
            return functools.partial(_causal, positions)
        shift = group.first_columns(block_size)[:, None] * block_size
        return functools.partial(_causal_window, positions - shift, group.window)
    logical = _logical_block_map(group, tables, num_source_blocks, block_size)
    if group.window:
        return functools.partial(_paged_window, logical, positions, block_size, group.window)
    return paged_causal_mask(logical, positions, block_size)


def _tile_block_ranges(
    group: _Group, max_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, tiles] each, table columns: [lo, hi) the blocks a tile sees at all, [full_lo,
    full_hi) those it sees whole (every row sees every key); tiles of padding rows see none.
    Causal alone: a tile's first row bounds the blocks seen whole, its last row the blocks seen
    at all.  A window starts the blocks seen at the first row's window and those seen whole
    at the last row's."""
    num_tiles = -(-max_len // Q_TILE)
    first = torch.arange(num_tiles, device=group.tables.device) * Q_TILE
    live = first[None, :] < group.query_lens[:, None]
    last = torch.minimum(first[None, :] + Q_TILE - 1, group.query_lens[:, None] - 1)
    context = (group.seq_lens - group.query_lens)[:, None]
    first_position, last_position = context + first[None, :], context + last
    full_hi = torch.where(live, (first_position + 1) // block_size, 0)
    hi = torch.where(live, last_position // block_size + 1, 0)
    if not group.window:
        zero = torch.zeros_like(hi)
        return zero, zero, full_hi, hi
    window = group.window
    lo = torch.where(live, (first_position - window + 1).clamp(min=0) // block_size, 0)
    full_lo = torch.where(live, -(-(last_position - window + 1).clamp(min=0) // block_size), 0)
    none_full = full_lo >= full_hi
    full_lo = torch.where(none_full, lo, full_lo)
    full_hi = torch.where(none_full, lo, full_hi)
    return lo, full_lo, full_hi, hi


def _logical_block_map(
    group: _Group, tables: torch.Tensor, num_source_blocks: int, block_size: int
) -> torch.Tensor:
    """[B, num_source_blocks] int32: each block's index in sequence b's table, -1 where b does
    not use it (or uses it before its window).  Padding entries are scattered into an extra
    column, then cut off."""
    batch, width = tables.shape
    column = torch.where(_valid_columns(group, block_size, width), tables, num_source_blocks)
    index = torch.arange(width, device=tables.device, dtype=torch.int32).expand(batch, width)
    logical = torch.full(
        (batch, num_source_blocks + 1), -1, dtype=torch.int32, device=tables.device
    )
    logical.scatter_(1, column, index)
    return logical[:, :num_source_blocks].contiguous()


def paged_causal_mask(
    logical: torch.Tensor,  # [B, num_source_blocks] from _logical_block_map
    positions: torch.Tensor,  # [B, L_max] position of each query row, -1 for padding
    block_size: int,
) -> Callable[..., torch.Tensor]:
    """A partial of one module-level function, not a fresh closure per step: torch.compile
    guards a closure on its identity and would retrace every step."""
    return functools.partial(_paged_causal, logical, positions, block_size)


def _paged_causal(logical, positions, block_size, b, h, q_idx, kv_idx):
    block = logical[b, kv_idx // block_size]
    key_position = block * block_size + kv_idx % block_size
    return (block >= 0) & (key_position <= positions[b, q_idx])


def _causal(positions, b, h, q_idx, kv_idx):
    return kv_idx <= positions[b, q_idx]


def _paged_window(logical, positions, block_size, window, b, h, q_idx, kv_idx):
    block = logical[b, kv_idx // block_size]
    key_position = block * block_size + kv_idx % block_size
    position = positions[b, q_idx]
    return (block >= 0) & (key_position <= position) & (key_position > position - window)


def _causal_window(positions, window, b, h, q_idx, kv_idx):
    position = positions[b, q_idx]
    return (kv_idx <= position) & (kv_idx > position - window)
