"""CUDA graphs for decode steps: capture once per (batch size, block-table width), replay.

A decode step launches hundreds of small kernels (per layer: norms, projections, RoPE, the
cache write, the gather, SDPA, the MLP); at small batch sizes the GPU waits on the CPU that
launches them.  A CUDA graph records the launches once and replays them with one call.  It
replays fixed shapes on fixed addresses, so:

* inputs live in static buffers (ids, positions, slots, seq lens, block tables) that each step
  copies into; a batch of B decodes runs the graph of the next captured batch size N >= B and
  block-table width W >= its longest table, the N - B pad rows decoding token 0 at position 0
  into a scratch *pad block* that is no part of the block pool (the engine allocates one block
  more than the pool's), so they never touch a request's K/V;
* the attention backend must be graph-safe for decode: the reference backend gathers
  [N, W x block_size] keys per layer and masks by seq len, with no host sync (the padding to W
  is what makes it so); prefills, mixed steps and batches past the largest graph run eagerly;
* the graphs share one memory pool, captured largest first so that each later graph fits in
  what the earlier ones left.

Widths: powers of two from MIN_GRAPH_BLOCKS up to the blocks of min(max_model_len,
MAX_GRAPH_SEQ_LEN) (vLLM V0's max_seq_len_to_capture); a (size, width) pair is captured only
while N x W x block_size <= MAX_GRAPH_GATHER_TOKENS, because the reference backend
materializes that many keys and values per layer (a paged kernel would not need the cap).
--enforce-eager turns graphs off (and torch.compile with them).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.attention.kv_cache import LayerKVCache, allocate_kv_caches
from kvserve.kv.spec import KVCacheSpec, cdiv

logger = logging.getLogger("kvserve")

CAPTURE_BATCH_SIZES = (1, 2, 4, *range(8, 257, 8))  # vLLM's pattern, up to 256 sequences
MIN_GRAPH_BLOCKS = 16
MAX_GRAPH_SEQ_LEN = 8192
MAX_GRAPH_GATHER_TOKENS = 1 << 17
WARM_UP_RUNS = 2  # before each capture: lazy initializations (cuBLAS handles, compile) first


def graphs_enabled(device: torch.device, enforce_eager: bool) -> bool:
    """Decode steps run through CUDA graphs on a CUDA device unless --enforce-eager."""
    return device.type == "cuda" and not enforce_eager


def decode_graph_plan(
    device: torch.device,
    enforce_eager: bool,
    backend: AttentionBackend,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> GraphPlan | None:
    """The decode graphs an engine captures; None (eager) without CUDA, with
    --enforce-eager, or with a backend that does not declare a graph-safe decode."""
    if not graphs_enabled(device, enforce_eager):
        return None
    if not backend_is_graph_safe(backend):
        logger.info(
            "attention %s does not declare a graph-safe decode: no CUDA graphs",
            type(backend).__name__,
        )
        return None
    return plan_graphs(max_num_seqs, max_model_len, block_size)


def describe(plan: GraphPlan) -> str:
    """'batch sizes 1-256 (35), block-table widths 16-512 (6)' for the start-up log."""
    return f"batch sizes {_span(plan.batch_sizes)}, block-table widths {_span(plan.block_widths)}"


def _span(values: tuple[int, ...]) -> str:
    return f"{values[0]}-{values[-1]} ({len(values)})" if len(values) > 1 else str(values[0])


def backend_is_graph_safe(backend: AttentionBackend) -> bool:
    """Whether the attention backend's own class declares its decode recordable
    (attention/base.py).  Not inherited: a subclass replaces the decode it was declared for
    (the C kernel's backend extends the reference one), so it must declare it again."""
    return bool(vars(type(backend)).get("graph_safe_decode", False))


@dataclass(frozen=True)
class GraphPlan:
    """The (batch size, block-table width) pairs to capture."""

    batch_sizes: tuple[int, ...]  # ascending
    block_widths: tuple[int, ...]  # ascending
    keys: frozenset[tuple[int, int]]

    @property
    def max_batch_size(self) -> int:
        return max(n for n, _ in self.keys)

    @property
    def max_block_width(self) -> int:
        return max(w for _, w in self.keys)

    def padded(self, num_seqs: int, num_blocks: int) -> tuple[int, int] | None:
        """The graph of a decode batch of `num_seqs` sequences whose longest block table has
        `num_blocks` blocks: the next captured size and width, or None (run eagerly)."""
        n = _next_at_least(self.batch_sizes, num_seqs)
        w = _next_at_least(self.block_widths, num_blocks)
        if n is None or w is None or (n, w) not in self.keys:
            return None
        return n, w


def _next_at_least(values: tuple[int, ...], x: int) -> int | None:
    i = bisect.bisect_left(values, x)
    return values[i] if i < len(values) else None


def capture_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes up to min(max_num_seqs, 256), that cap included."""
    cap = min(max_num_seqs, CAPTURE_BATCH_SIZES[-1])
    sizes = [n for n in CAPTURE_BATCH_SIZES if n <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return tuple(sizes)


def capture_block_widths(max_model_len: int, block_size: int) -> tuple[int, ...]:
    """Powers of two from MIN_GRAPH_BLOCKS, ending with the blocks of the longest sequence
    a graph covers."""
    longest = cdiv(min(max_model_len, MAX_GRAPH_SEQ_LEN), block_size)
    widths = []
    width = MIN_GRAPH_BLOCKS
    while width < longest:
        widths.append(width)
        width *= 2
    widths.append(longest)
    return tuple(widths)


def plan_graphs(
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    max_gather_tokens: int = MAX_GRAPH_GATHER_TOKENS,
) -> GraphPlan:
    sizes = capture_batch_sizes(max_num_seqs)
    widths = capture_block_widths(max_model_len, block_size)
    keys = frozenset(
        (n, w) for n in sizes for w in widths if n * w * block_size <= max_gather_tokens
    )
    if not keys:  # a single sequence always gets its narrowest graph
        keys = frozenset({(1, widths[0])})
    return GraphPlan(sizes, widths, keys)


class DecodeGraphs:
    """The captured decode graphs of one runner and their static input buffers."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[LayerKVCache],
        backend: AttentionBackend,
        block_size: int,
        plan: GraphPlan,
        pad_block_id: int,
    ) -> None:
        device = kv_caches[0].key.device
        self.device = device
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.plan = plan
        self.pad_block_id = pad_block_id
        self.pad_slot = pad_block_id * block_size
        n, w = plan.max_batch_size, plan.max_block_width
        long = {"dtype": torch.long, "device": device}
        self.input_ids = torch.zeros(n, **long)  # [N]
        self.positions = torch.zeros(n, **long)  # [N]
        self.slot_mapping = torch.full((n,), self.pad_slot, **long)  # [N]
        self.seq_lens = torch.ones(n, **long)  # [N]
        self.block_tables = torch.full((n, w), pad_block_id, **long)  # [N, W]
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self.pool_bytes = 0  # device memory the capture reserved (its pool), for the log

    def forward(self, n: int, w: int) -> torch.Tensor:
        """The model over the first `n` rows of the static buffers, tables `w` wide."""
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:n],
            num_decode_tokens=n,
            decode_block_tables=self.block_tables[:n, :w],
            decode_seq_lens=self.seq_lens[:n],
            prefills=(),
        )
        return self.model(
            self.input_ids[:n], self.positions[:n], self.kv_caches, metadata, self.backend
        )

    @torch.inference_mode()
    def capture(self, record: bool = True) -> float:
        """Capture every planned graph, largest first into one shared pool; returns seconds.
        record=False keeps the static buffers and the padding but runs each step eagerly
        (how the padding is tested on a CPU, where there is no graph)."""
        started = time.monotonic()
        if not record:
            self._graphs = dict.fromkeys(self.plan.keys, (None, None))
            return time.monotonic() - started
        reserved = torch.cuda.memory_reserved(self.device)
        with torch.cuda.device(self.device):
            pool = torch.cuda.graph_pool_handle()
            for n, w in sorted(self.plan.keys, reverse=True):
                self._graphs[n, w] = self._capture_one(n, w, pool)
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        return time.monotonic() - started

    def _capture_one(self, n: int, w: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (as torch.cuda.graph expects), then record."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARM_UP_RUNS):
                self.forward(n, w)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.forward(n, w)
        return graph, out

    def run(
        self,
        input_ids: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B]
        slot_mapping: torch.Tensor,  # [B]
        seq_lens: torch.Tensor,  # [B]
        block_tables: torch.Tensor,  # [B, cols]
    ) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a decode-only batch through its graph, or None when
        no captured graph covers it (the caller runs it eagerly).  The result is a view of
        the graph's output: use it before the next step."""
        b, cols = block_tables.shape
        key = self.plan.padded(b, cols)
        if key is None or key not in self._graphs:
            return None
        n, w = key
        self._fill(n, w, input_ids, positions, slot_mapping, seq_lens, block_tables)
        graph, out = self._graphs[key]
        if graph is None:
            out = self.forward(n, w)
        else:
            graph.replay()
        return out[:b]

    def _fill(self, n: int, w: int, input_ids, positions, slot_mapping, seq_lens, tables) -> None:
        """Copy a batch into the static buffers; rows b..n-1 become pad rows."""
        b, cols = tables.shape
        for buffer, values, pad in (
            (self.input_ids, input_ids, 0),
            (self.positions, positions, 0),
            (self.slot_mapping, slot_mapping, self.pad_slot),
            (self.seq_lens, seq_lens, 1),
        ):
            buffer[:b].copy_(values)
            buffer[b:n].fill_(pad)
        self.block_tables[:n, :w].fill_(self.pad_block_id)
        self.block_tables[:b, :cols].copy_(tables)


def profile_graph_pool_bytes(
    model: torch.nn.Module,
    spec: KVCacheSpec,
    backend: AttentionBackend,
    device: torch.device,
    plan: GraphPlan,
) -> int:
    """An estimate of the graphs' shared pool, for the start-up sizing (before the KV cache
    exists): the peak memory of an eager decode step at the graphs that need the most (the
    widest gather and the largest batch), over a throwaway cache of one table's blocks."""
    keys = {max(plan.keys, key=lambda k: (k[0] * k[1], k[0])), max(plan.keys)}
    peak = 0
    for n, w in keys:
        caches = allocate_kv_caches(spec, w + 1, device)
        single = GraphPlan((n,), (w,), frozenset({(n, w)}))
        graphs = DecodeGraphs(model, caches, backend, spec.block_size, single, pad_block_id=w)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.inference_mode():
            graphs.forward(n, w)
        torch.cuda.synchronize(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device) - before)
        del caches, graphs
    torch.cuda.empty_cache()
    return peak
