"""The evaluation's view of the paged forward pass (runner/paged_forward.py): KV dtypes the
evaluation alone accepts, and a cache allocated from a model config and dtype names.

The evaluation compares KV dtypes on the *same* weights, so it builds the model once and one
cache per dtype (runner/paged_forward.py drives the model through it as serving does).
"""

from __future__ import annotations

import torch

from kvserve.config import KV_CACHE_DTYPES, ModelConfig
from kvserve.errors import ParameterError
from kvserve.kv.spec import KVCacheSpec, kv_cache_spec
from kvserve.native import platform
from kvserve.runner.paged_forward import (
    PagedCache,
    Piece,
    allocate_paged_cache,
    contiguous_tables,
    forward_hidden,
)

__all__ = [
    "EVAL_KV_DTYPES", "PagedCache", "Piece", "allocate_cache", "check_kv_dtypes",
    "contiguous_tables", "forward_hidden", "make_spec",
]  # fmt: skip

# Storage dtypes accepted by the evaluation only: a 16-bit cache under a float32 model is the
# "16-bit baseline" on CPUs where the model itself runs in float32; int4_unrotated is int4
# without its rotation (attention/rotation.py), to measure what the rotation buys.
UNROTATED = {"int4_unrotated": "int4"}
EVAL_ONLY_KV_DTYPES = ("float32", "float16", *UNROTATED)
EVAL_KV_DTYPES = KV_CACHE_DTYPES + EVAL_ONLY_KV_DTYPES


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
        config.num_layers, config.num_kv_heads, config.head_dim,
        UNROTATED.get(kv_dtype, kv_dtype), model_dtype_name, block_size,
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
    return allocate_paged_cache(spec, num_blocks, device, rotate=kv_dtype not in UNROTATED)
