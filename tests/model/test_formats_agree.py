"""The loader and the planner agree on every field they share, for real checkpoints: the
embedded GGUF and the tiny Hugging Face directories of each supported architecture."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from kvserve.formats.gguf_metadata import GGUFFields, open_gguf
from kvserve.models.gguf_loader import read_gguf_config
from kvserve.models.loader import embedded_model_path, load_checkpoint
from kvserve.planner.model import LayerKind
from kvserve.planner.readers import load_model_shape


def assert_common_fields_agree(config: Any, shape: Any, skip: tuple[str, ...] = ()) -> None:
    """Every field ModelConfig and ModelShape share, but `architecture` (ours is normalized:
    "llama", the planner shows it as written) and `skip`."""
    common = {f.name for f in fields(config)} & {f.name for f in fields(shape)}
    assert {"num_kv_heads", "attention_bias", "tie_word_embeddings"} <= common
    for name in sorted(common - {"architecture", "sliding_window", *skip}):
        assert getattr(config, name) == getattr(shape, name), name
    # The planner keeps the window as written (None: none), the loader the one it attends
    # with (0: none); both agree on each layer's.
    planner = tuple(
        shape.sliding_window if kind == LayerKind.SLIDING else 0 for kind in shape.layer_kinds
    )
    assert config.layer_windows() == (planner or (0,) * config.num_layers)


def test_embedded_gguf_reads_the_same_in_loader_and_planner() -> None:
    path = embedded_model_path()
    config = read_gguf_config(GGUFFields(open_gguf(path), str(path)))  # no dequantizing
    shape = load_model_shape(str(path))
    # torch_dtype differs by design: the loader dequantizes to float32, the planner reports
    # the dtype a quantized file computes in.
    assert_common_fields_agree(config, shape, skip=("torch_dtype",))
    assert (config.num_layers, config.num_kv_heads, config.max_position_embeddings) == (
        30, 3, 8192,
    )  # fmt: skip
    assert config.tie_word_embeddings and not config.attention_bias


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "mistral"])
def test_tiny_hf_directories_read_the_same_in_loader_and_planner(tiny_model_dir, arch) -> None:
    directory, hf_model = tiny_model_dir(arch)
    config = load_checkpoint(str(directory)).config
    shape = load_model_shape(str(directory))
    assert_common_fields_agree(config, shape)
    has_bias = hf_model.model.layers[0].self_attn.q_proj.bias is not None
    assert config.attention_bias is shape.attention_bias is has_bias
