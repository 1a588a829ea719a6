"""Qwen3 (q/k norms, head_dim != hidden / heads, sliding layers from max_window_layers),
Gemma 3 text (Gemma norms, GELU, scaled embeddings, query_pre_attn_scalar, local and global
RoPE, interleaved sliding layers) and Mistral with a sliding window: tiny random-weight
transformers models, served by the offline LLM on the reference attention backend in float32,
give transformers' greedy tokens exactly over prompts four times the window; the same weights
written as GGUF (tensor names and metadata as llama.cpp's convert_hf_to_gguf.py writes them)
load into the same model and give the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from helpers import add_gguf_shape, forward_logits, hf_greedy, make_cache
from test_formats_agree import assert_common_fields_agree
from windowed_models import NEW_TOKENS, PROMPT, WINDOW

from kvserve import LLM, SamplingParams
from kvserve.evaluation.paged import Piece
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import ModelLoadError, load_checkpoint
from kvserve.planner.readers import load_model_shape


def our_greedy(model: LlamaForCausalLM, ids: list[int], num_tokens: int) -> list[int]:
    """Argmax decoding through the paged cache and the reference backend."""
    block_size = 16
    total = len(ids) + num_tokens
    table = list(range((total + block_size - 1) // block_size))
    cache = make_cache(model, num_blocks=len(table) + 1, block_size=block_size)
    (logits,) = forward_logits(model, cache, [Piece("r", ids, 0, table)])
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < num_tokens:
        piece = Piece("r", [tokens[-1]], len(ids) + len(tokens) - 1, table)
        (logits,) = forward_logits(model, cache, [piece])
        tokens.append(int(logits[-1].argmax()))
    return tokens


def from_checkpoint(path) -> LlamaForCausalLM:
    ckpt = load_checkpoint(str(path))
    return LlamaForCausalLM.from_weights(
        ckpt.config, ckpt.weights, torch.float32, torch.device("cpu")
    )


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "mistral"])
def test_greedy_tokens_match_transformers(tiny, reference, arch):
    directory, _ = tiny(arch)
    llm = LLM(str(directory), kv_cache_memory=8 * 2**20, max_model_len=512, dtype="float32",
              attention_backend="torch")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([PROMPT], params)
    assert out[0].outputs[0].token_ids == reference(arch)


def test_the_window_changes_the_tokens(tiny, reference):
    """The comparison sees the window: the same Mistral weights without it decode otherwise."""
    _, hf = tiny("mistral")
    hf.config.sliding_window = None
    try:
        full = hf_greedy(hf, PROMPT, NEW_TOKENS)
    finally:
        hf.config.sliding_window = WINDOW
    assert full != reference("mistral")


def test_configs_read_from_config_json(tiny):
    qwen = load_checkpoint(str(tiny("qwen3")[0])).config
    assert (qwen.architecture, qwen.head_dim, qwen.qk_norm, qwen.attention_bias) == (
        "qwen3", 32, True, False,
    )  # fmt: skip
    assert qwen.layer_windows() == (0, WINDOW)
    assert qwen.max_position_embeddings == 1024  # no longer capped at the window
    gemma = load_checkpoint(str(tiny("gemma3")[0])).config
    assert gemma.layer_windows() == (WINDOW,) * 5 + (0,)
    assert (gemma.rope_theta, gemma.rope_local_base_freq) == (1e6, 1e4)
    assert gemma.rope_scaling["rope_type"] == "linear" and gemma.rope_scaling["factor"] == 4.0
    assert gemma.gemma_norms and gemma.tie_word_embeddings and gemma.query_pre_attn_scalar == 24
    mistral = load_checkpoint(str(tiny("mistral")[0])).config
    assert mistral.layer_windows() == (WINDOW, WINDOW)
    assert mistral.max_position_embeddings == 1024


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "mistral"])
def test_loader_and_planner_agree(tiny, arch):
    directory = str(tiny(arch)[0])
    assert_common_fields_agree(load_checkpoint(directory).config, load_model_shape(directory))


def test_compiled_layers_match_eager(tiny):
    """The engine's default path (torch.compile of the layers) computes Gemma's math too."""
    model = from_checkpoint(tiny("gemma3")[0])
    tokens = PROMPT[:120]
    eager = our_logits(model, tokens)
    model.compile()
    compiled = our_logits(model, tokens)
    assert (compiled - eager).abs().max().item() < 1e-4


def our_logits(model, tokens):
    table = list(range(len(tokens) // 16 + 1))
    cache = make_cache(model, num_blocks=len(table) + 1, block_size=16)
    return forward_logits(model, cache, [Piece("r", tokens, 0, table)])[0]


# -- GGUF ---------------------------------------------------------------------------------

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
}  # fmt: skip
# llama.cpp's names of the norms around the MLP: Llama's one, Gemma's three.
_NORMS = {
    "llama": {"post_attention_layernorm": "ffn_norm"},
    "qwen3": {"post_attention_layernorm": "ffn_norm"},
    "gemma3": {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
}  # fmt: skip


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(path, hf_model, arch: str) -> None:
    """As convert_hf_to_gguf.py: Mistral as `llama` (q/k rows permuted), Qwen3 as `qwen3`
    (its mixed layers as a per-layer sliding_window_pattern), Gemma 3 as `gemma3` (norms with
    the +1 added; no output.weight: tied; its query_pre_attn_scalar as attention.scale)."""
    cfg = hf_model.config
    writer = GGUFWriter(str(path), arch)
    add_gguf_shape(writer, cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(WINDOW)
    if arch == "gemma3":
        rope = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
        # Not written by the converter (llama.cpp takes head_dim): our tiny model's is not.
        writer.add_attention_scale(cfg.query_pre_attn_scalar**-0.5)
    else:
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "qwen3":
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.numpy().astype(np.float32)
        gguf_name = _gguf_name(name, arch)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        if arch == "llama" and gguf_name.endswith("attn_q.weight"):
            array = _permute(array, cfg.num_attention_heads)
        elif arch == "llama" and gguf_name.endswith("attn_k.weight"):
            array = _permute(array, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_name(hf_name: str, arch: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES.get(module) or _NORMS[arch][module]}.{kind}"


@pytest.mark.parametrize(
    ("arch", "gguf_arch"), [("qwen3", "qwen3"), ("gemma3", "gemma3"), ("mistral", "llama")]
)
def test_gguf_gives_the_same_tokens(tmp_path, tiny, reference, arch, gguf_arch):
    directory, hf = tiny(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, hf, gguf_arch)
    from_gguf = load_checkpoint(str(path)).config
    from_hf = load_checkpoint(str(directory)).config
    assert_common_fields_agree(from_gguf, load_model_shape(str(path)), skip=("torch_dtype",))
    for name in ("layer_types", "sliding_window", "qk_norm", "gemma_norms", "rope_theta",
                 "rope_local_base_freq", "query_pre_attn_scalar", "embedding_multiplier",
                 "tie_word_embeddings", "head_dim"):  # fmt: skip
        if arch == "mistral" and name == "layer_types":
            continue  # () and all sliding alike
        assert getattr(from_gguf, name) == getattr(from_hf, name), name
    assert our_greedy(from_checkpoint(path), PROMPT, NEW_TOKENS) == reference(arch)


def test_logit_softcapping_is_refused(tmp_path, tiny):
    capped = _edited_copy(tmp_path, tiny("gemma3")[0], final_logit_softcapping=30.0)
    with pytest.raises(ModelLoadError, match="final_logit_softcapping"):
        load_checkpoint(str(capped))


def _edited_copy(tmp_path, directory, **changes):
    import json
    import shutil

    copy = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(directory, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **changes}))
    return copy


def test_unserved_configs_are_refused_by_name(tmp_path, tiny):
    directory = tiny("gemma3")[0]
    multimodal = _edited_copy(tmp_path, directory, architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(ModelLoadError, match="unsupported architecture 'Gemma3ForConditionalGen"):
        load_checkpoint(str(multimodal))
    short = _edited_copy(tmp_path, directory, layer_types=["full_attention"])
    with pytest.raises(
        ModelLoadError, match="'layer_types' lists 1 layers; num_hidden_layers is 6"
    ):
        load_checkpoint(str(short))
