"""--weight-dtype int8 on a model: greedy tokens equal to those of the same model whose float
weights are replaced by the dequantized ones (the reference), one row a decode step (the
kernel) after a prefill, tied and untied LM heads; and the same through LLM(...)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import contiguous_tables, forward_logits, make_cache

from kvserve.config import ModelConfig
from kvserve.evaluation.paged import Piece
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.quantized_linear import ALL_ROWS, Q8Linear, Q8Plan, dequantize_q8, quantize_q8

CPU = torch.device("cpu")
BLOCK_SIZE = 4
PROMPT = [5, 77, 301, 12, 499, 250, 3, 41, 160, 222, 7]
NUM_TOKENS = 12
# intermediate_size 80: down_proj's inputs end in a partial block of 16
CONFIG = ModelConfig(
    architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=80, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
)  # fmt: skip
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def random_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    h, inter = config.hidden_size, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = {"embed_tokens.weight": (config.vocab_size, h), "norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        shapes |= {
            f"layers.{i}.qkv_proj.weight": (qkv, h), f"layers.{i}.o_proj.weight": (h, h),
            f"layers.{i}.gate_up_proj.weight": (2 * inter, h),
            f"layers.{i}.down_proj.weight": (h, inter),
            f"layers.{i}.input_layernorm.weight": (h,),
            f"layers.{i}.post_attention_layernorm.weight": (h,),
        }  # fmt: skip
    return {
        name: (1.0 if name.endswith("norm.weight") else 0.0)
        + torch.randn(shape, generator=gen) * 0.2
        for name, shape in shapes.items()
    }


def dequantized_reference(config: ModelConfig, weights: dict[str, torch.Tensor]):
    """A float model whose projections and LM head hold the dequantized weights (the
    embedding table keeps its float values for the lookups, as int8's does)."""
    swapped = dict(weights)
    for name, weight in weights.items():
        if name.split(".")[-2] in PROJECTIONS:
            swapped[name] = dequantize_q8(*quantize_q8(weight), weight.shape[1])
    head = weights["lm_head.weight" if "lm_head.weight" in weights else "embed_tokens.weight"]
    swapped["lm_head.weight"] = dequantize_q8(*quantize_q8(head), head.shape[1])
    untied = replace(config, tie_word_embeddings=False)
    return LlamaForCausalLM.from_weights(untied, swapped, torch.float32, CPU)


def greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """A prefill of the prompt, then one row a step."""
    (table,) = contiguous_tables(1, len(prompt) + num_tokens, BLOCK_SIZE)
    cache = make_cache(model, num_blocks=len(table) + 1, block_size=BLOCK_SIZE)
    logits = forward_logits(model, cache, [Piece("r", prompt, 0, table)])[0]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < num_tokens:
        piece = Piece("r", tokens[-1:], len(prompt) + len(tokens) - 1, table)
        tokens.append(int(forward_logits(model, cache, [piece])[0][-1].argmax()))
    return tokens


@pytest.mark.parametrize("tied", [True, False])
def test_int8_greedy_tokens_equal_the_dequantized_reference(tied):
    config = replace(CONFIG, tie_word_embeddings=tied)
    weights = random_weights(config)
    model = LlamaForCausalLM.from_weights(
        config, weights, torch.float32, CPU, Q8Plan(ALL_ROWS, keep_float=False)
    )
    assert all(isinstance(getattr(layer, p), Q8Linear) for layer in model.layers
               for p in PROJECTIONS)  # fmt: skip
    assert isinstance(model.logits_head, Q8Linear)
    want = greedy(dequantized_reference(config, weights), PROMPT, NUM_TOKENS)
    assert greedy(model, PROMPT, NUM_TOKENS) == want
    # and not the float model's: the 8-bit rounding is there to be seen in the logits
    float_model = LlamaForCausalLM.from_weights(config, weights, torch.float32, CPU)
    (table,) = contiguous_tables(1, len(PROMPT), BLOCK_SIZE)
    pieces = [Piece("r", PROMPT, 0, table)]
    quantized_logits = forward_logits(model, make_cache(model, len(table) + 1, BLOCK_SIZE), pieces)
    float_logits = forward_logits(
        float_model, make_cache(float_model, len(table) + 1, BLOCK_SIZE), pieces
    )
    assert not torch.equal(quantized_logits[0], float_logits[0])


def test_llm_serves_int8_weights_and_names_a_quantized_gguf(tmp_path, tiny_model_dir):
    """Through LLM(...) (the engine's path, eager), int8's greedy tokens are the reference's;
    a Q8_0 GGUF is named as stored quantized (what --weight-dtype auto looks at)."""
    from gguf import GGMLQuantizationType
    from test_gguf import write_gguf

    from kvserve import LLM, SamplingParams
    from kvserve.models.loader import load_checkpoint

    directory, hf = tiny_model_dir("mistral")
    checkpoint = load_checkpoint(str(directory))
    llm = LLM(str(directory), weight_dtype="int8", dtype="float32", enforce_eager=True,
              kv_cache_memory=8 * 2**20, max_model_len=256)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    (out,) = llm.generate(["The capital of France is"], params)
    reference = dequantized_reference(checkpoint.config, checkpoint.weights)
    assert out.outputs[0].token_ids == greedy(reference, out.prompt_token_ids, NUM_TOKENS)
    path = tmp_path / "tiny-q8.gguf"
    write_gguf(path, hf, GGMLQuantizationType.Q8_0)
    assert load_checkpoint(str(path)).config.stored_weight_type == "Q8_0"
