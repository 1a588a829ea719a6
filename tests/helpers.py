"""Test helpers that drive the model through the paged KV cache without the scheduler."""

from __future__ import annotations

import torch

from kvserve.evaluation.paged import (
    PagedCache,
    Piece,
    allocate_cache,
    contiguous_tables,
    forward_hidden,
)

CPU = torch.device("cpu")


def make_cache(model, num_blocks: int, block_size: int, kv_dtype: str = "auto") -> PagedCache:
    """A paged cache on the CPU for the model's dtype (kv_dtype auto stores that dtype)."""
    model_dtype = next(model.parameters()).dtype
    return allocate_cache(model.config, kv_dtype, model_dtype, block_size, num_blocks, CPU)


@torch.inference_mode()
def forward_logits(model, cache: PagedCache, pieces: list[Piece]) -> list[torch.Tensor]:
    """One step over several pieces; returns each piece's logits [num_tokens, vocab]."""
    return [model.compute_logits(h) for h in forward_hidden(model, cache, pieces, CPU)]


def run_in_chunks(model, token_ids: list[int], chunk_size: int, block_size: int = 4):
    """Prefill `token_ids` in chunks of `chunk_size` into a fresh cache; all logits [L, V]."""
    (table,) = contiguous_tables(1, len(token_ids), block_size)
    cache = make_cache(model, num_blocks=len(table) + 1, block_size=block_size)
    out = []
    for start in range(0, len(token_ids), chunk_size):
        piece = Piece("r", token_ids[start : start + chunk_size], start, table)
        out.append(forward_logits(model, cache, [piece])[0])
    return torch.cat(out)


@torch.no_grad()
def hf_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """Plain argmax decoding with transformers' own KV cache, never stopping at EOS
    (`generate(min_new_tokens=...)` would instead forbid EOS and change the tokens)."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(num_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(
            torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
        )
    return tokens


def add_gguf_shape(writer, cfg) -> None:  # noqa: ANN001 - a GGUFWriter, a transformers config
    """The model-shape metadata every GGUF writer of the tests starts with."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


def count_step_rows(monkeypatch, cls) -> list[int]:
    """The row counts (hidden's) of the steps that `cls.run_step` serves from now on: a
    one-call decode path's (NativeLayers, Q8DecodeStep)."""
    rows = []
    original = cls.run_step

    def counted(self, layers, hidden, *args):
        rows.append(hidden.shape[0])
        return original(self, layers, hidden, *args)

    monkeypatch.setattr(cls, "run_step", counted)
    return rows
