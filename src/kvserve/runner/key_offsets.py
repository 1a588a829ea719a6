"""Each layer's mean key and key channel scales, applied to the keys a 4-bit cache stores.

Keys carry an offset that every token shares (a few channels sit far from zero in all of
them); the rotation (attention/rotation.py) spreads it over every channel of the row, and
the row's 4-bit grid then spends its 16 levels on the offset instead of on what tells one key
from another.  Subtracting a fixed vector m from every key of a head changes no attention
weight: q . (k - m) = q . k - q . m, and q . m is the same for every key a query scores, which
the softmax cancels.  So the offset goes, and only the keys' differences are quantized.

The channel scales s (one per channel of a KV head) move the rounding to where the queries
look least: keys are stored as (k - m) / s, and the queries of the head multiplied by s, so
q . k is unchanged (SmoothQuant's trick, on the keys: QServe's SmoothAttention).  A key's
rounding error, even across the channels of the rotated row, lands in channel c as s_c times
it, and the score's error weighs it by the query's channel: s_c = (var(k_c) / E[q_c^2]) ** 1/4
minimizes the expected error of q . k over the two's statistics (Cauchy-Schwarz).

m and s must be the same for every key a query may attend (any sequence, any step, a prefix
cached hours ago): they are measured once, at start-up, on a fixed text (the KV dtype check's
canary), by the model itself, deterministically.  Measured on the embedded model (eval-kv,
int4, docs/decisions/kv-int4-rotation.md): the offsets took the perplexity increase over a
float32 cache from 5.0% to 3.5% on 2,048 tokens; the channel scales help only with the
row's scale chosen among several (kv_quant.INT4_SCALE_DIVISORS).

The key sink is the calibration text's first key as the cache stores it.  The first token of a
text draws much of every query's attention (the attention sink), and its keys, far from the
others, are alike whatever the token: an int4 cache stores the keys near the sink relative to
it (kv_quant.py), so their rounding is that of a small row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention import rotation
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv.spec import cdiv, kv_cache_spec
from kvserve.runner.paged_forward import Piece, allocate_paged_cache, forward_hidden

CALIBRATION_BLOCK_SIZE = 16
CHANNEL_SCALE_EXPONENT = 0.25  # s = (var(k) / E[q^2]) ** 0.25
_MIN_MOMENT = 1e-8  # a channel with no spread keeps a finite scale


@dataclass(frozen=True)
class KeyStatistics:
    """One layer's keys and queries on the calibration text, float32 [kv_heads, head_dim]
    each, after RoPE (as attention sees them); queries averaged over each KV head's group."""

    mean_key: torch.Tensor
    key_variance: torch.Tensor
    query_square: torch.Tensor
    first_key: torch.Tensor  # the first token's: where the attention sink's keys lie

    def channel_scale(self) -> torch.Tensor:
        ratio = self.key_variance.clamp(min=_MIN_MOMENT) / self.query_square.clamp(min=_MIN_MOMENT)
        return ratio**CHANNEL_SCALE_EXPONENT


class _QueryMoments(TorchRefBackend):
    """The reference backend, summing each layer's squared queries per KV head's channel."""

    def __init__(self, layer_of_cache: dict[int, int]) -> None:
        super().__init__()
        self.layer_of_cache = layer_of_cache
        self.sums: dict[int, torch.Tensor] = {}

    def forward(self, query, key, value, kv_cache, metadata, scale):  # noqa: ANN001, ANN201
        tokens, _, dim = query.shape
        grouped = query.float().reshape(tokens, key.shape[1], -1, dim)
        layer = self.layer_of_cache[id(kv_cache)]
        self.sums[layer] = self.sums.get(layer, 0) + grouped.square().sum((0, 2))
        return super().forward(query, key, value, kv_cache, metadata, scale)


def key_statistics(
    model: torch.nn.Module, token_ids: list[int], device: torch.device
) -> list[KeyStatistics]:
    """Per layer, the keys' mean and variance and the queries' second moment of `token_ids`
    prefilled at once through a float32 cache of the model's own KV heads (this rank's, with
    tensor parallelism: every rank runs it at once)."""
    layers = model.layers
    spec = kv_cache_spec(
        len(layers), layers[0].num_kv_heads, layers[0].head_dim, "float32", "float32",
        CALIBRATION_BLOCK_SIZE,
    )  # fmt: skip
    num_blocks = cdiv(len(token_ids), CALIBRATION_BLOCK_SIZE)
    cache = allocate_paged_cache(spec, num_blocks, device)
    queries = _QueryMoments({id(layer): i for i, layer in enumerate(cache.layers)})
    forward_hidden(model, cache, [Piece("calibration", token_ids, 0, list(range(num_blocks)))],
                   device, queries)  # fmt: skip
    count = len(token_ids)
    group = layers[0].num_heads // layers[0].num_kv_heads
    stats = []
    for i, layer in enumerate(cache.layers):
        keys = layer.key.flatten(0, 1)[:count].float()
        stats.append(KeyStatistics(keys.mean(0), keys.var(0, correction=0),
                                   queries.sums[i] / (count * group), keys[0]))  # fmt: skip
    return stats


def calibrate_key_offsets(
    model: torch.nn.Module, token_ids: list[int], device: torch.device
) -> None:
    """Set each layer's key channel scales, key offset (its mean key, scaled and rotated as
    a 4-bit cache stores keys) and key sink (the text's first key, as the cache stores it:
    scaled, rotated, less the offset) on the model, which applies them where the cache keeps
    rotated rows."""
    stats = key_statistics(model, token_ids, device)
    scales = [s.channel_scale() for s in stats]
    offsets = [rotation.rotate(s.mean_key / scale) for s, scale in zip(stats, scales, strict=True)]
    sinks = [
        rotation.rotate(s.first_key / scale) - offset
        for s, scale, offset in zip(stats, scales, offsets, strict=True)
    ]
    model.set_key_offsets(offsets, scales, sinks)
