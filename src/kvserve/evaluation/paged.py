"""Drive one loaded model through a paged KV cache of any dtype, without the scheduler.

The evaluation compares KV dtypes on the *same* weights, so it builds the model once and one
cache per dtype, and calls the model the way the model runner does (build_batch_input ->
build_attention_metadata -> model.forward), so attention reads the cache exactly as serving
does: quantized on write, dequantized on gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.kv_cache import LayerKVCache, allocate_kv_caches
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.config import KV_CACHE_DTYPES, ModelConfig
from kvserve.errors import ParameterError
from kvserve.kv.spec import KVCacheSpec, cdiv, kv_cache_spec
from kvserve.request import SamplingParams
from kvserve.runner import platform
from kvserve.runner.model_runner import build_attention_metadata, build_batch_input
from kvserve.step import ScheduledRequest

# Unquantized storage dtypes accepted by the evaluation only: a 16-bit cache under a float32
# model is the "16-bit baseline" on CPUs where the model itself runs in float32.
EVAL_ONLY_KV_DTYPES = ("float32", "bfloat16", "float16")
EVAL_KV_DTYPES = KV_CACHE_DTYPES + EVAL_ONLY_KV_DTYPES


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


def check_kv_dtypes(kv_dtypes: list[str]) -> None:
    """ValueError naming the flag for an empty list or an unknown name (before any loading)."""
    if not kv_dtypes:
        raise ParameterError("--kv-cache-dtypes", "give at least one KV dtype")
    for kv_dtype in kv_dtypes:
        if kv_dtype not in EVAL_KV_DTYPES:
            raise ParameterError(
                "--kv-cache-dtypes",
                f"unknown KV dtype {kv_dtype!r}; choose from {', '.join(EVAL_KV_DTYPES)}",
            )


def make_spec(
    config: ModelConfig, kv_dtype: str, model_dtype: torch.dtype, block_size: int
) -> KVCacheSpec:
    """The engine's accounting function for this model, KV dtype and compute dtype."""
    check_kv_dtypes([kv_dtype])
    model_dtype_name = platform.dtype_name(model_dtype)
    return kv_cache_spec(
        config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype, model_dtype_name,
        block_size,
    )  # fmt: skip


def allocate_cache(
    config: ModelConfig,
    kv_dtype: str,
    model_dtype: torch.dtype,
    block_size: int,
    num_blocks: int,
    device: torch.device,
) -> PagedCache:
    spec = make_spec(config, kv_dtype, model_dtype, block_size)
    return PagedCache(spec, allocate_kv_caches(spec, num_blocks, device), num_blocks)


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
    model: torch.nn.Module, cache: PagedCache, pieces: list[Piece], device: torch.device
) -> list[torch.Tensor]:
    """One step over `pieces` (their K/V are written into `cache`); returns each piece's final
    hidden states [num_tokens, hidden], in the order given.

    The runner's contract is decodes (1-token pieces) first, so pieces are sorted for the
    batch and mapped back afterwards."""
    requests = sorted((_scheduled(p) for p in pieces), key=lambda r: r.num_tokens > 1)
    block_size = cache.spec.block_size
    batch = build_batch_input(requests, block_size, device)
    metadata = build_attention_metadata(batch, block_size)
    hidden = model(batch.input_ids, batch.positions, cache.layers, metadata, TorchRefBackend())
    starts = batch.query_start_loc.tolist()
    by_id = {r.request_id: hidden[starts[i] : starts[i + 1]] for i, r in enumerate(requests)}
    return [by_id[p.seq_id] for p in pieces]


def contiguous_tables(num_sequences: int, num_tokens: int, block_size: int) -> list[list[int]]:
    """Disjoint block tables, one per sequence, each holding `num_tokens` tokens."""
    per_seq = cdiv(num_tokens, block_size)
    return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_sequences)]
