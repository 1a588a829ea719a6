"""The one reader per metadata format (kvserve.formats): the loader and the planner read a
config.json or a GGUF file the same way, and name a bad field and its file the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvserve.errors import UserInputError
from kvserve.formats import FormatError
from kvserve.formats.hf_config import parse_hf_config
from kvserve.models.loader import ModelLoadError, load_checkpoint, model_config_from_hf
from kvserve.planner.model import PlanError
from kvserve.planner.readers import load_model_shape, shape_from_hf_config

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}


def _both(config: dict[str, Any]) -> tuple[Any, Any]:
    """The loader's ModelConfig and the planner's ModelShape of one config.json dict."""
    return model_config_from_hf(config), shape_from_hf_config(config, "t", "config.json")


@pytest.mark.parametrize(
    ("identity", "expected"),
    [
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, True),
        ({"architectures": ["Qwen2ForCausalLM"]}, True),  # no model_type: the class names it
        ({"model_type": "qwen2"}, True),
        ({"model_type": "qwen2", "attention_bias": False}, False),  # an explicit field wins
        ({"model_type": "llama"}, False),
        ({"model_type": "llama", "attention_bias": True}, True),
        ({"architectures": ["MistralForCausalLM"]}, False),
    ],
)
def test_qwen2_bias_rule_is_the_same_in_loader_and_planner(
    identity: dict[str, Any], expected: bool
) -> None:
    loaded, shape = _both({**BASE, **identity})
    assert loaded.attention_bias is expected
    assert shape.attention_bias is expected


def test_qwen2_family_beyond_what_the_engine_runs() -> None:
    moe = {**BASE, "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}
    assert shape_from_hf_config(moe, "t", "config.json").attention_bias
    qwen3 = {**BASE, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    assert not shape_from_hf_config(qwen3, "t", "config.json").attention_bias


def _errors(model: Path) -> tuple[str, str]:
    with pytest.raises(ModelLoadError) as loaded:
        load_checkpoint(str(model))
    with pytest.raises(PlanError) as planned:
        load_model_shape(str(model))
    return str(loaded.value), str(planned.value)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"intermediate_size": None}, "config has no 'intermediate_size' (the MLP width)"),
        ({"num_key_value_heads": 0}, "'num_key_value_heads' must be a positive integer, got 0"),
        ({"rms_norm_eps": "tiny"}, "'rms_norm_eps' must be a positive number"),
        ({"eos_token_id": "</s>"}, "'eos_token_id' must be token ids"),
        ({"torch_dtype": "float64"}, "'torch_dtype' is 'float64'"),
    ],
)
def test_a_bad_config_field_is_named_with_its_file_by_both(
    tmp_path: Path, change: dict[str, Any], needle: str
) -> None:
    config = {**BASE, "architectures": ["LlamaForCausalLM"], **change}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    loaded, planned = _errors(tmp_path)
    assert loaded == planned
    assert loaded.startswith(f"{path}: ") and needle in loaded


def test_an_unreadable_config_is_named_by_both(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    loaded, planned = _errors(tmp_path)
    assert loaded == planned and "cannot read a JSON config" in loaded


def test_the_architecture_is_checked_before_the_fields() -> None:
    with pytest.raises(ModelLoadError, match="unsupported architecture 'BertModel'"):
        model_config_from_hf({"architectures": ["BertModel"]})


def _write_gguf(path: Path, *, hidden: bool = True) -> None:
    """A llama GGUF with the keys the engine needs (optionally without embedding_length)."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    if hidden:
        writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_context_length(256)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(100)
    writer.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_missing_gguf_key_is_named_with_its_file_by_both(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    _write_gguf(path, hidden=False)
    loaded, planned = _errors(path)
    assert loaded == planned == f"{path}: GGUF has no 'llama.embedding_length'"


def test_a_junk_gguf_is_named_by_both(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf at all")
    loaded, planned = _errors(path)
    assert loaded == planned and loaded.startswith(f"{path}: not a readable GGUF file")


def test_transformers_5_rope_parameters() -> None:
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    hf = parse_hf_config({**BASE, "rope_parameters": rope}, "config.json")
    assert hf.rope_theta == 1e6 and hf.rope_scaling == rope
    plain = {"rope_type": "default", "rope_theta": 5e5}
    hf = parse_hf_config({**BASE, "rope_parameters": plain, "rope_scaling": {}}, "config.json")
    assert hf.rope_theta == 5e5 and hf.rope_scaling is None


def test_multimodal_config_reads_its_text_config() -> None:
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "torch_dtype": "bfloat16",
        "eos_token_id": 7,
        "text_config": {**BASE, "model_type": "qwen2_vl_text", "dtype": "float32"},
    }
    hf = parse_hf_config(config, "config.json")
    assert hf.architecture == "Qwen2VLForConditionalGeneration"  # inherited from the top
    assert (hf.num_layers, hf.torch_dtype, hf.eos_token_ids) == (2, "bfloat16", (7,))
    assert hf.attention_bias  # the Qwen2 family by its text model_type


def test_sliding_window_turned_off_by_use_sliding_window() -> None:
    config = {**BASE, "model_type": "qwen2", "max_position_embeddings": 32768}
    loaded, shape = _both({**config, "sliding_window": 4096, "use_sliding_window": False})
    assert loaded.max_position_embeddings == shape.max_position_embeddings == 32768
    assert loaded.sliding_window == 0 and loaded.layer_windows() == (0, 0)
    loaded = model_config_from_hf({**config, "sliding_window": 4096, "max_window_layers": 1})
    # The context is no longer capped at the window: the sliding layers attend within it.
    assert loaded.max_position_embeddings == 32768
    assert loaded.layer_windows() == (0, 4096)  # Qwen2 slides from max_window_layers on


def test_format_error_is_user_input() -> None:
    with pytest.raises(FormatError) as info:
        parse_hf_config({}, "here/config.json")
    assert isinstance(info.value, UserInputError)  # the CLI's one-line exit 2, never a bug
    assert str(info.value) == (
        "here/config.json: config has no 'num_hidden_layers' (the number of layers)"
    )
