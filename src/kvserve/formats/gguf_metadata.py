"""The one reader of GGUF key/value metadata, in llama.cpp's key names (``{arch}.block_count``).

The loader builds ModelConfig from ``GGUFMetadata`` and then dequantizes the tensors; the
planner builds a ModelShape from it and only lists the tensors (their sizes), never reads
them.  Two facts llama.cpp writes as tensors rather than keys are read from the tensor names:
no ``output.weight`` means tied embeddings, a ``blk.0.attn_q.bias`` means a q/k/v bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.formats import FormatError

# The layer pattern llama.cpp fixes for an architecture whose converter writes none
# ({arch}.attention.sliding_window_pattern): every n-th layer is global, the others slide.
DEFAULT_SLIDING_WINDOW_PATTERNS = {"gemma3": 6}

# GGUFMetadata fields that some files lack, and the key each comes from (after "{arch}.").
_OPTIONAL_KEYS = {
    "intermediate_size": "feed_forward_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "context_length",
}


@dataclass(frozen=True)
class GGUFMetadata:
    """The validated common fields of a GGUF file's metadata."""

    architecture: str  # general.architecture, e.g. "llama"
    name: str | None  # general.name
    num_layers: int
    hidden_size: int
    intermediate_size: int | None
    vocab_size: int
    num_heads: int
    num_kv_heads: int  # of the layers that have attention
    kv_heads_per_layer: tuple[int, ...] | None  # hybrid models: 0 marks a layer without one
    head_dim: int
    rms_norm_eps: float | None
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # {"rope_type": ..., "factor": ...}
    max_position_embeddings: int | None  # {arch}.context_length
    sliding_window: int | None
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    source: str

    def need(self, name: str) -> Any:
        """A field the caller cannot do without; FormatError naming its GGUF key otherwise."""
        value = getattr(self, name)
        if value is None:
            key = f"{self.architecture}.{_OPTIONAL_KEYS[name]}"
            raise FormatError(f"{self.source}: GGUF has no '{key}'")
        return value


def open_gguf(path: Path) -> Any:
    """A gguf.GGUFReader over `path` (memory-mapped: nothing is read until asked for)."""
    from gguf import GGUFReader  # keeps `gguf` (and numpy) off the planner's import path

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueErrors/asserts on junk
        raise FormatError(f"{path}: not a readable GGUF file ({exc})") from None


class GGUFFields:
    """GGUF key/value access with errors that name the missing key and the file."""

    def __init__(self, reader: Any, source: str) -> None:
        self.reader = reader
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise FormatError(f"{self.source}: GGUF has no '{key}'")
        return value

    def require_int(self, key: str) -> int:
        """A positive integer; a per-layer list gives the value of the layers that have one."""
        value = first_nonzero(self.require(key))
        if value <= 0:
            raise FormatError(f"{self.source}: '{key}' must be a positive integer, got {value!r}")
        return value

    def architecture(self) -> str:
        """Read first: every other key is named after it."""
        return str(self.require("general.architecture"))

    def has_tensor(self, name: str) -> bool:
        return any(tensor.name == name for tensor in self.reader.tensors)


def read_gguf_metadata(fields: GGUFFields) -> GGUFMetadata:
    """GGUF metadata -> GGUFMetadata; FormatError naming the missing key and the file."""
    arch = fields.architecture()
    num_layers = fields.require_int(f"{arch}.block_count")
    hidden = fields.require_int(f"{arch}.embedding_length")
    num_heads = fields.require_int(f"{arch}.attention.head_count")
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", num_heads)
    name = fields.get("general.name")
    return GGUFMetadata(
        architecture=arch,
        name=None if name is None else str(name),
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=first_nonzero(fields.get(f"{arch}.feed_forward_length", 0)) or None,
        vocab_size=_vocab_size(fields, arch),
        num_heads=num_heads,
        num_kv_heads=first_nonzero(kv_heads),
        kv_heads_per_layer=tuple(kv_heads) if isinstance(kv_heads, list) else None,
        head_dim=int(fields.get(f"{arch}.attention.key_length") or hidden // num_heads),
        rms_norm_eps=_optional_float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=_rope_scaling(fields, arch),
        max_position_embeddings=fields.get(f"{arch}.context_length"),
        sliding_window=fields.get(f"{arch}.attention.sliding_window"),
        tie_word_embeddings=not fields.has_tensor("output.weight"),
        attention_bias=fields.has_tensor("blk.0.attn_q.bias"),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_token_ids(fields.get("tokenizer.ggml.eos_token_id")),
        source=fields.source,
    )


def first_nonzero(value: Any) -> int:
    """Per-layer arrays (hybrid models) -> the value of the layers that have one."""
    if isinstance(value, list):
        value = next((v for v in value if v), 0)
    return int(value)


def _vocab_size(fields: GGUFFields, arch: str) -> int:
    """The key when written, else the tokenizer's token list, else the embedding's rows."""
    vocab = fields.get(f"{arch}.vocab_size")
    if vocab:
        return int(vocab)
    tokens = fields.reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    for tensor in fields.reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(max(tensor.shape))
    raise FormatError(f"{fields.source}: GGUF has no vocabulary size ({arch}.vocab_size)")


def _rope_scaling(fields: GGUFFields, arch: str) -> dict[str, Any] | None:
    kind = fields.get(f"{arch}.rope.scaling.type")
    factor = fields.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    return {"rope_type": str(kind), "factor": float(factor)}


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _token_ids(value: Any) -> tuple[int, ...]:
    return () if value is None else (int(value),)
