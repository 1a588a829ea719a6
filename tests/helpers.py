"""Test helpers that drive the model through the paged KV cache without the scheduler."""

from __future__ import annotations

import torch

from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.engine.outputs import ScheduledRequest
from kvserve.kv.spec import kv_cache_spec
from kvserve.request import SamplingParams
from kvserve.runner.kv_storage import LayerKVCache, allocate_kv_caches
from kvserve.runner.model_runner import build_attention_metadata, build_batch_input


def make_caches(model, num_blocks: int, block_size: int, kv_dtype: str = "auto"):
    c = model.config
    spec = kv_cache_spec(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype, "float32", block_size)
    return allocate_kv_caches(spec, num_blocks, torch.device("cpu"))


def chunk(request_id: str, token_ids: list[int], start: int, block_table: list[int]):
    return ScheduledRequest(
        request_id=request_id,
        token_ids=token_ids,
        start_position=start,
        block_table=block_table,
        sample=True,
        sampling_params=SamplingParams(temperature=0.0),
        num_output_tokens=0,
        eos_token_ids=frozenset(),
    )


@torch.inference_mode()
def forward_logits(
    model, caches: list[LayerKVCache], block_size: int, chunks: list[ScheduledRequest]
) -> list[torch.Tensor]:
    """One step over several chunks; returns each chunk's logits [num_tokens, vocab]."""
    requests = sorted(chunks, key=lambda r: r.num_tokens > 1)  # the runner's order
    batch = build_batch_input(requests, block_size, torch.device("cpu"))
    metadata = build_attention_metadata(batch, block_size)
    hidden = model(batch.input_ids, batch.positions, caches, metadata, TorchRefBackend())
    logits = model.compute_logits(hidden)
    starts = batch.query_start_loc.tolist()
    by_id = {r.request_id: logits[starts[i] : starts[i + 1]] for i, r in enumerate(requests)}
    return [by_id[c.request_id] for c in chunks]


def run_in_chunks(model, token_ids: list[int], chunk_size: int, block_size: int = 4):
    """Prefill `token_ids` in chunks of `chunk_size` into a fresh cache; all logits [L, V]."""
    caches = make_caches(
        model, num_blocks=-(-len(token_ids) // block_size) + 1, block_size=block_size
    )
    table = list(range(-(-len(token_ids) // block_size)))
    out = []
    for start in range(0, len(token_ids), chunk_size):
        piece = token_ids[start : start + chunk_size]
        out.append(forward_logits(model, caches, block_size, [chunk("r", piece, start, table)])[0])
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
