"""Tensor parallelism of the Llama family (Megatron-style): which rank holds which heads,
MLP columns and vocabulary rows, and the layers that join the ranks with one collective each.

Per decoder layer, two all-reduces and nothing else:

    hidden (replicated) -> qkv_proj  column-parallel: this rank's q heads and their KV heads
                        -> attention over this rank's heads and its own KV cache
                        -> o_proj    row-parallel: partial sums, all-reduce
                        -> gate_up   column-parallel: this rank's MLP columns
                        -> down_proj row-parallel: partial sums, all-reduce

Head rule (a GQA group never straddles two ranks, so attention needs no communication):
  * num_kv_heads >= tp: KV heads are split as evenly as possible, the first ranks taking one
    more (SmolLM2's 3 KV heads on 2 ranks: 2 + 1), and every rank computes the query heads of
    its KV heads (6 + 3 of the 9). Uneven, but nothing is padded or computed twice; the
    KV cache is sized for the largest share (kv/spec.py kv_heads_per_rank, cdiv), which is
    rank 0's, so every rank fits the same number of blocks.
  * num_kv_heads < tp: tp must be a multiple of num_kv_heads; each KV head is replicated on
    tp / num_kv_heads ranks, which split its group of query heads (8 q / 2 KV on 4 ranks:
    2 q + 1 KV each).

Vocabulary: vocabulary-parallel embedding and LM head (rows split in equal, zero-padded
shares). They are the largest single tensors of a small model (SmolLM2: 28 of its 135 M
parameters), so replicating them would cost every rank a fifth of the model. The embedding
all-reduces its rows (an id outside a rank's share reads zeros); the head all-gathers the
logits, so that every rank holds the full [N, vocab] and samples the same tokens (rank 0's are
used; see executor/).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.errors import ParameterError
from kvserve.kv.spec import cdiv


@dataclass(frozen=True)
class RankShard:
    """What one rank holds: index ranges into the full model's heads, MLP columns and vocab."""

    rank: int
    world_size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    vocab_per_rank: int  # every rank's share padded to this many rows (for the all-gather)


def split_evenly(total: int, parts: int) -> list[range]:
    """Contiguous ranges covering range(total); the first `total % parts` get one more."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for part in range(parts):
        size = base + (1 if part < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def _head_ranges(num_heads: int, num_kv_heads: int, tp: int) -> list[tuple[range, range]]:
    """(q heads, KV heads) of each rank by the rule in the module docstring."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        kv = split_evenly(num_kv_heads, tp)
        return [(range(r.start * group, r.stop * group), r) for r in kv]
    if tp % num_kv_heads or group < tp // num_kv_heads:
        raise ParameterError(
            "--tensor-parallel-size",
            f"{tp} ranks cannot share {num_kv_heads} KV heads / {num_heads} query heads: with "
            "fewer KV heads than ranks, the size must be a multiple of the KV heads and at "
            f"most the query heads; use at most {num_kv_heads} or a multiple of it",
        )
    replicas = tp // num_kv_heads
    out = []
    for rank in range(tp):
        kv_head = rank // replicas
        part = split_evenly(group, replicas)[rank % replicas]
        q = range(kv_head * group + part.start, kv_head * group + part.stop)
        out.append((q, range(kv_head, kv_head + 1)))
    return out


def shard_plan(config: ModelConfig, tp: int) -> list[RankShard]:
    """Every rank's share; ParameterError naming --tensor-parallel-size when none exists."""
    if tp < 1:
        raise ParameterError("--tensor-parallel-size", f"must be positive, got {tp}")
    if tp > config.intermediate_size:
        raise ParameterError("--tensor-parallel-size", "exceeds the MLP's intermediate size")
    heads = _head_ranges(config.num_heads, config.num_kv_heads, tp)
    mlp = split_evenly(config.intermediate_size, tp)
    per = cdiv(config.vocab_size, tp)
    return [
        RankShard(
            rank=rank,
            world_size=tp,
            q_heads=heads[rank][0],
            kv_heads=heads[rank][1],
            intermediate=mlp[rank],
            vocab=range(
                min(rank * per, config.vocab_size), min((rank + 1) * per, config.vocab_size)
            ),
            vocab_per_rank=per,
        )
        for rank in range(tp)
    ]


def local_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The shape this rank's modules are built with (the vocabulary stays whole: the runner
    samples over all of it)."""
    return replace(
        config,
        num_heads=len(shard.q_heads),
        num_kv_heads=len(shard.kv_heads),
        intermediate_size=len(shard.intermediate),
    )


def _rows(tensor: torch.Tensor, heads: range, head_dim: int, offset: int = 0) -> torch.Tensor:
    return tensor[offset + heads.start * head_dim : offset + heads.stop * head_dim]


def shard_weights(
    config: ModelConfig, weights: dict[str, torch.Tensor], shard: RankShard
) -> dict[str, torch.Tensor]:
    """The full checkpoint (our names) -> this rank's slices, as contiguous copies so that the
    full tensors can be freed."""
    d = config.head_dim
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    inter, size = shard.intermediate, config.intermediate_size
    out = {}
    for name, tensor in weights.items():
        kind = name.rsplit(".", 2)[-2] if "." in name else name
        if kind == "qkv_proj":
            parts = (
                _rows(tensor, shard.q_heads, d),
                _rows(tensor, shard.kv_heads, d, q_size),
                _rows(tensor, shard.kv_heads, d, q_size + kv_size),
            )
            tensor = torch.cat(parts)
        elif kind == "o_proj":
            tensor = tensor[:, shard.q_heads.start * d : shard.q_heads.stop * d]
        elif kind == "gate_up_proj":
            tensor = torch.cat((tensor[inter.start : inter.stop],
                                tensor[size + inter.start : size + inter.stop]))  # fmt: skip
        elif kind == "down_proj":
            tensor = tensor[:, inter.start : inter.stop]
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            tensor = tensor[shard.vocab.start : shard.vocab.stop]
        out[name] = tensor.contiguous()
    return out


class TPGroup:
    """The ranks' process group (gloo on CPU, NCCL on CUDA), created without torch's global
    default group so that several engines (or tests) in one process never share state."""

    def __init__(self, process_group: object, rank: int, world_size: int) -> None:
        self.process_group = process_group
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        self.process_group.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (equal shapes), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.process_group.allgather([out], [tensor]).wait()
        return out


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's input columns, whose partial sums are all-reduced: the
    result is the full layer's, replicated on every rank."""

    def __init__(self, inner: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table; ids outside them read zeros, and the sum over
    ranks is the full lookup."""

    def __init__(self, weight: torch.Tensor, vocab: range, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [len(vocab), hidden]
        self.vocab = vocab
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        inside = (input_ids >= self.vocab.start) & (input_ids < self.vocab.stop)
        local = (input_ids - self.vocab.start).clamp(0, max(0, len(self.vocab) - 1))
        hidden = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(hidden)


class VocabParallelHead(nn.Module):
    """LM head over this rank's vocabulary rows; the logits of all ranks are gathered, so the
    result is the full [N, vocab] on every rank."""

    def __init__(
        self, weight: torch.Tensor, vocab_size: int, per_rank: int, group: TPGroup
    ) -> None:
        super().__init__()
        self.weight = weight  # [rows <= per_rank, hidden], shared with a tied embedding
        self.vocab_size = vocab_size
        self.per_rank = per_rank
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        local = F.linear(hidden, self.weight)
        missing = self.per_rank - local.shape[-1]
        if missing:
            local = F.pad(local, (0, missing))
        return torch.cat(self.group.all_gather(local.contiguous()), dim=-1)[:, : self.vocab_size]


def build_sharded_model(
    model_cls: type,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    shard: RankShard,
    group: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """This rank's model: built on the meta device with the local shape, given its slices of
    the weights, then joined to the group (embedding, LM head, o_proj and down_proj)."""
    from kvserve.models.packed_linear import can_pack, pack_linear_layers

    state = {
        name: tensor.to(device=device, dtype=dtype)
        for name, tensor in shard_weights(config, weights, shard).items()
    }
    head_weight = state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = model_cls(local_config(config, shard))
        model.embed_tokens = VocabParallelEmbedding(
            torch.empty(len(shard.vocab), config.hidden_size), shard.vocab, group
        )
        if not config.tie_word_embeddings:
            del model.lm_head
    model.load_state_dict(state, strict=True, assign=True)
    model.set_rope(device)
    model.eval()
    if can_pack(device, dtype):
        pack_linear_layers(model.layers)
    model.use_fused_silu(device, dtype)
    for layer in model.layers:
        layer.o_proj = RowParallelLinear(layer.o_proj, group)
        layer.down_proj = RowParallelLinear(layer.down_proj, group)
    head = model.embed_tokens.weight if head_weight is None else head_weight
    model.logits_head = VocabParallelHead(head, config.vocab_size, shard.vocab_per_rank, group)
    return model
