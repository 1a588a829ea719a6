"""A GGUF written here with the `gguf` writer (F32 and Q8_0 tensors, llama.cpp's Q/K row
permutation applied as its converter does) loads back into the same model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from helpers import add_gguf_shape, run_in_chunks

from kvserve.models.gguf_loader import unpermute_qk
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import ModelLoadError, load_checkpoint

NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the inverse of our unpermute_qk)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(path, hf_model, quant: GGMLQuantizationType, arch: str = "llama") -> None:
    cfg = hf_model.config
    writer = GGUFWriter(str(path), arch)
    add_gguf_shape(writer, cfg)
    writer.add_rope_freq_base(10000.0)
    for name, tensor in hf_model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        gguf_name = _gguf_name(name)
        if gguf_name.endswith("attn_q.weight"):
            array = permute(array, cfg.num_attention_heads)
        elif gguf_name.endswith("attn_k.weight"):
            array = permute(array, cfg.num_key_value_heads)
        if array.ndim == 2 and quant != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{NAMES[module]}.{kind}"


def test_unpermute_inverts_the_converter():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(unpermute_qk(permute(w, 3), 3), w)


def test_f32_gguf_round_trips_exactly(tmp_path, tiny_model_dir):
    directory, hf = tiny_model_dir("mistral")
    path = tmp_path / "tiny-f32.gguf"
    write_gguf(path, hf, GGMLQuantizationType.F32)
    from_gguf = load_checkpoint(str(path))
    from_hf = load_checkpoint(str(directory))
    assert from_gguf.config.num_kv_heads == 2 and not from_gguf.config.tie_word_embeddings
    assert from_gguf.config.stored_weight_type == ""  # --weight-dtype auto keeps it float
    assert from_gguf.weights.keys() == from_hf.weights.keys()
    for name, tensor in from_hf.weights.items():
        assert torch.equal(from_gguf.weights[name], tensor), name


def test_q8_0_gguf_loads_within_quantization_error(tmp_path, tiny_model_dir):
    _, hf = tiny_model_dir("mistral")
    path = tmp_path / "tiny-q8.gguf"
    write_gguf(path, hf, GGMLQuantizationType.Q8_0)
    ckpt = load_checkpoint(str(path))
    hf_q = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    ours_q = ckpt.weights["layers.0.qkv_proj.weight"][: hf_q.shape[0]]
    # Q8_0: blocks of 32 values, scale absmax/127 stored as fp16 (relative error 2^-11):
    # error <= absmax / 254 (rounding) + 127 * scale * 2^-11 (the scale's own rounding).
    absmax = hf_q.abs().max().item()
    bound = absmax / 254 + absmax / 2048
    assert (ours_q - hf_q).abs().max().item() <= bound
    model = LlamaForCausalLM.from_weights(
        ckpt.config, ckpt.weights, torch.float32, torch.device("cpu")
    )
    tokens = list(range(100, 140))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    ours = run_in_chunks(model, tokens, chunk_size=40)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(path), "phi2")
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError, match="unsupported GGUF architecture 'phi2'; supported: llama, qwen2"
    ):
        load_checkpoint(str(path))


def test_non_model_files_are_refused(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_checkpoint(str(junk))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint(str(tmp_path / "missing.gguf"))
    (tmp_path / "cfgdir").mkdir()
    (tmp_path / "cfgdir" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_checkpoint(str(tmp_path / "cfgdir"))


@pytest.fixture
def cached_conversions(tmp_path, monkeypatch):
    """A private cache directory, and every GGUF file stored however small."""
    from kvserve.models import converted_cache

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(converted_cache, "MIN_CACHED_BYTES", 0)
    return tmp_path / "cache" / "models"


def _refuse_conversion(path):
    raise AssertionError(f"{path} was converted again")


def test_a_second_load_reads_the_stored_conversion(
    tmp_path, tiny_model_dir, cached_conversions, monkeypatch, caplog
):
    from kvserve.models import gguf_loader

    caplog.set_level("INFO", logger="kvserve.models.converted_cache")
    _, hf = tiny_model_dir("mistral")
    path = tmp_path / "tiny-q8.gguf"
    write_gguf(path, hf, GGMLQuantizationType.Q8_0)
    first = load_checkpoint(str(path))
    (entry,) = cached_conversions.iterdir()
    assert f"converted weights stored in {entry}" in caplog.text
    monkeypatch.setattr(gguf_loader, "convert_gguf", _refuse_conversion)
    second = load_checkpoint(str(path))
    assert second.config == first.config
    assert second.weights.keys() == first.weights.keys()
    for name, tensor in first.weights.items():
        assert torch.equal(second.weights[name], tensor), name


def test_a_rewritten_file_converts_again_and_replaces_its_entry(
    tmp_path, tiny_model_dir, cached_conversions
):
    _, hf = tiny_model_dir("mistral")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, GGMLQuantizationType.Q8_0)
    load_checkpoint(str(path))
    (old,) = cached_conversions.iterdir()
    write_gguf(path, hf, GGMLQuantizationType.F32)
    from_f32 = load_checkpoint(str(path))
    (new,) = cached_conversions.iterdir()
    assert new != old
    for name, tensor in load_checkpoint(str(path)).weights.items():
        assert torch.equal(from_f32.weights[name], tensor), name


def test_a_corrupt_entry_is_converted_again(tmp_path, tiny_model_dir, cached_conversions, caplog):
    _, hf = tiny_model_dir("mistral")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, GGMLQuantizationType.F32)
    first = load_checkpoint(str(path))
    (entry,) = cached_conversions.iterdir()
    (entry / "model.safetensors").write_bytes(b"not a safetensors file")
    again = load_checkpoint(str(path))
    assert "unreadable" in caplog.text
    for name, tensor in first.weights.items():
        assert torch.equal(again.weights[name], tensor), name
