"""The one reader of a Hugging Face config.json: the fields the loader and the planner share.

Both build from ``HFConfig``: the loader turns it into the engine's ModelConfig, the planner
into a ModelShape (and reads its own extras -- experts, MLA, layer kinds, quantization -- from
``HFConfig.raw`` through the same ``FieldReader``).  Defaults here are the ones transformers
applies when a field is absent; what a caller adds on top (the engine's 2048-token fallback
context, the planner's bfloat16 guess for an unnamed dtype) stays with that caller.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.config import TransformerShape
from kvserve.formats import FormatError

CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")
# What a multimodal config keeps at its top level while the text model's shape is in
# text_config; the text model inherits these unless text_config sets them itself.
_TOP_LEVEL_FIELDS = (
    "architectures",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "quantization_config",
    "_name_or_path",
)
_MISSING = object()


@dataclass(frozen=True)
class HFConfig(TransformerShape):
    """The validated common fields of a config.json (of its text model, when multimodal);
    `architecture` is the first of `architectures`, else model_type, as written."""

    model_type: str
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int | None  # None: the config does not say
    sliding_window: int | None  # as written; see use_sliding_window
    use_sliding_window: bool
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None  # one of CHECKPOINT_DTYPES; None: the config does not say
    raw: Mapping[str, Any]  # the text model's fields, for what only one caller reads
    source: str  # the file (or preset) named in errors

    @property
    def effective_sliding_window(self) -> int | None:
        """The window attention is limited to: Qwen2 writes one but turns it off."""
        return self.sliding_window if self.use_sliding_window else None


def read_config_json(path: Path) -> dict[str, Any]:
    """The JSON object in a config.json file; FormatError naming the file otherwise."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path}: cannot read a JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise FormatError(f"{path}: a config.json must hold a JSON object")
    return config


def text_fields(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal config's text_config (with the top-level fields it inherits), else config.

    The checkpoint's dtype is the top-level one when both say: it names the stored weights."""
    text = config.get("text_config")
    if "num_hidden_layers" in config or not isinstance(text, Mapping):
        return config
    inherited = {key: config[key] for key in _TOP_LEVEL_FIELDS if key in config}
    dtype = _dtype_value(config) or _dtype_value(text)
    return {**inherited, **text, "torch_dtype": dtype}


def architecture_of(config: Mapping[str, Any]) -> str:
    """The architecture as written, checked before anything else so an unsupported model is
    named as such rather than by the first field it lacks."""
    text = text_fields(config)
    architectures = text.get("architectures") or [text.get("model_type") or "unknown"]
    return str(architectures[0] if isinstance(architectures, list) else architectures)


def is_qwen2_family(model_type: str, architecture: str) -> bool:
    """Qwen2, Qwen2.5, Qwen2-MoE and the Qwen2 VL/audio text models carry a q/k/v bias, and
    their config class has no attention_bias field to say so; Qwen3 and later write it."""
    return model_type.lower().startswith("qwen2") or architecture.lower().startswith("qwen2")


def parse_hf_config(config: Mapping[str, Any], source: str) -> HFConfig:
    """config.json fields -> HFConfig; FormatError naming the field and `source`."""
    raw = text_fields(config)
    field = FieldReader(raw, source)
    architecture = architecture_of(raw)
    model_type = str(raw.get("model_type") or "")
    bias = field.optional_bool("attention_bias")
    return HFConfig(
        architecture=architecture,
        model_type=model_type,
        **_shape_fields(field),
        rms_norm_eps=field.positive_float("rms_norm_eps", 1e-6),
        **_rope_fields(field),
        max_position_embeddings=field.optional_int("max_position_embeddings"),
        sliding_window=field.optional_int("sliding_window"),
        use_sliding_window=bool(field.optional_bool("use_sliding_window", True)),
        tie_word_embeddings=bool(field.optional_bool("tie_word_embeddings", False)),
        attention_bias=is_qwen2_family(model_type, architecture) if bias is None else bias,
        bos_token_id=field.token_id("bos_token_id"),
        eos_token_ids=field.token_ids("eos_token_id"),
        torch_dtype=field.dtype(),
        raw=raw,
        source=source,
    )


def _shape_fields(field: FieldReader) -> dict[str, int]:
    """The sizes; read in this order so a config missing most of them names the layer count."""
    num_layers = field.positive_int("num_hidden_layers", "the number of layers")
    hidden = field.positive_int("hidden_size", "the model width")
    num_heads = field.positive_int("num_attention_heads", "the number of query heads")
    return {
        "num_layers": num_layers,
        "hidden_size": hidden,
        "num_heads": num_heads,
        "intermediate_size": field.positive_int("intermediate_size", "the MLP width"),
        "vocab_size": field.positive_int("vocab_size", "the vocabulary size"),
        "num_kv_heads": field.positive_int("num_key_value_heads", "KV heads", default=num_heads),
        "head_dim": field.positive_int("head_dim", "the head size", default=hidden // num_heads),
    }


def _rope_fields(field: FieldReader) -> dict[str, Any]:
    """RoPE base and scaling; transformers >= 5 folds both into `rope_parameters`, per layer
    type for models whose local layers have their own (Gemma 3: the full layers' here)."""
    rope = field.mapping("rope_parameters") or {}
    if isinstance(rope.get("full_attention"), Mapping):
        rope = rope["full_attention"]
    scaling = field.mapping("rope_scaling") or None
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = rope
    theta = field.positive_float("rope_theta", rope.get("rope_theta") or 10000.0)
    return {"rope_theta": theta, "rope_scaling": None if scaling is None else dict(scaling)}


def _dtype_value(config: Mapping[str, Any]) -> Any:
    return config.get("torch_dtype") or config.get("dtype")


class FieldReader:
    """Typed access to config.json fields with errors that name the field and the file."""

    def __init__(self, config: Mapping[str, Any], source: str) -> None:
        self.config = config
        self.source = source

    def positive_int(self, key: str, meaning: str, default: Any = _MISSING) -> int:
        value = self.config.get(key)
        if value is None:
            if default is _MISSING:
                raise FormatError(f"{self.source}: config has no '{key}' ({meaning})")
            value = default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise FormatError(f"{self.source}: '{key}' must be a positive integer, got {value!r}")
        return value

    def optional_int(self, key: str) -> int | None:
        value = self.config.get(key)
        return None if value is None else self.positive_int(key, key)

    def positive_float(self, key: str, default: float) -> float:
        value = self.config.get(key)
        if value is None:
            return float(default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise FormatError(f"{self.source}: '{key}' must be a positive number, got {value!r}")
        return float(value)

    def optional_bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise FormatError(f"{self.source}: '{key}' must be true or false, got {value!r}")
        return value

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        value = self.config.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise FormatError(f"{self.source}: '{key}' must be a JSON object, got {value!r}")
        return value

    def token_id(self, key: str) -> int | None:
        value = self.config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise FormatError(f"{self.source}: '{key}' must be a token id, got {value!r}")
        return value

    def token_ids(self, key: str) -> tuple[int, ...]:
        """One id or a list of them (Llama 3 lists several end-of-turn tokens)."""
        value = self.config.get(key)
        values = value if isinstance(value, list) else [] if value is None else [value]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise FormatError(f"{self.source}: '{key}' must be token ids, got {value!r}")
        return tuple(values)

    def dtype(self) -> str | None:
        value = _dtype_value(self.config)
        if value is not None and value not in CHECKPOINT_DTYPES:
            raise FormatError(
                f"{self.source}: 'torch_dtype' is {value!r}; expected one of "
                f"{', '.join(CHECKPOINT_DTYPES)}"
            )
        return value
