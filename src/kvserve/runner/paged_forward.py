"""Drive a loaded model through a paged KV cache of any dtype, without the scheduler.

Used where the same weights must be run through caches of several KV dtypes: the engine's
start-up check of an 8-bit KV cache (executor/kv_dtype_check.py) and the evaluation of KV dtypes
(kvserve eval-kv).  The model is called the way the model runner calls it
(build_batch_input -> build_attention_metadata -> model.forward), so attention reads the cache
exactly as serving does: quantized on write, dequantized on gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.kv_cache import LayerKVCache, allocate_kv_caches
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv.spec import KVCacheSpec, cdiv
from kvserve.request import SamplingParams
from kvserve.runner.model_runner import build_attention_metadata, build_batch_input
from kvserve.step import ScheduledRequest


@dataclass(frozen=True)
class Piece:
    """A run of one sequence's tokens computed in one step (a prefill chunk or a decode)."""

    seq_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]


@dataclass
class PagedCache:
    """One KV dtype's cache tensors and the accounting they were allocated from."""

    spec: KVCacheSpec
    layers: list[LayerKVCache]
    num_blocks: int


def allocate_paged_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device, rotate: bool = True
) -> PagedCache:
    """`rotate`: as allocate_kv_caches (False: a 4-bit cache of unrotated rows)."""
    return PagedCache(spec, allocate_kv_caches(spec, num_blocks, device, rotate=rotate), num_blocks)


def _scheduled(piece: Piece) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=piece.seq_id,
        token_ids=piece.token_ids,
        start_position=piece.start_position,
        block_table=piece.block_table,
        sample=True,
        sampling_params=SamplingParams(temperature=0.0),
        num_output_tokens=0,
        eos_token_ids=frozenset(),
    )


@torch.inference_mode()
def forward_hidden(
    model: torch.nn.Module,
    cache: PagedCache,
    pieces: list[Piece],
    device: torch.device,
    backend: AttentionBackend | None = None,
) -> list[torch.Tensor]:
    """One step over `pieces` (their K/V are written into `cache`); returns each piece's final
    hidden states [num_tokens, hidden], in the order given.  `backend`: the reference's
    attention unless given (benchmarks/long_context_decode.py times the C kernels here).

    The runner's contract is decodes (1-token pieces) first, so pieces are sorted for the
    batch and mapped back afterwards."""
    requests = sorted((_scheduled(p) for p in pieces), key=lambda r: r.num_tokens > 1)
    block_size = cache.spec.block_size
    batch = build_batch_input(requests, block_size, device)
    metadata = build_attention_metadata(batch, block_size)
    backend = backend or TorchRefBackend()
    hidden = model(batch.input_ids, batch.positions, cache.layers, metadata, backend)
    starts = batch.query_start_loc.tolist()
    by_id = {r.request_id: hidden[starts[i] : starts[i + 1]] for i, r in enumerate(requests)}
    return [by_id[p.seq_id] for p in pieces]


def contiguous_tables(num_sequences: int, num_tokens: int, block_size: int) -> list[list[int]]:
    """Disjoint block tables, one per sequence, each holding `num_tokens` tokens."""
    per_seq = cdiv(num_tokens, block_size)
    return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_sequences)]


@torch.inference_mode()
def chunked_prefill_logits(
    model: torch.nn.Module,
    cache: PagedCache,
    token_ids: list[int],
    chunk_size: int,
    device: torch.device,
) -> torch.Tensor:
    """Logits [num_tokens, vocab] (float32) of one sequence prefilled in chunks of
    `chunk_size`: every chunk after the first attends over K/V read back from `cache`."""
    (table,) = contiguous_tables(1, len(token_ids), cache.spec.block_size)
    if len(table) > cache.num_blocks:
        raise ValueError(f"the cache holds {cache.num_blocks} blocks; {len(table)} are needed")
    logits = []
    for start in range(0, len(token_ids), chunk_size):
        piece = Piece("canary", token_ids[start : start + chunk_size], start, table)
        (hidden,) = forward_hidden(model, cache, [piece], device)
        logits.append(model.compute_logits(hidden).float())
    return torch.cat(logits)
