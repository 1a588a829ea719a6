"""The planner's description of a model: only the shape fields that decide weights and KV bytes.

A ``ModelShape`` comes from a preset, a Hugging Face config.json or a GGUF file's metadata
(see ``readers.py``), so one accounting path serves all three.  It is deliberately wider than
the engine's ``ModelConfig``: the planner must also describe models the engine cannot run yet
(MLA, mixture of experts, sliding-window layers, layers without attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvserve.errors import UserInputError


class PlanError(UserInputError):
    """Bad planner input; the message names what is missing and how to fix it (CLI exit 2)."""


class LayerKind(Enum):
    """What one decoder layer keeps in the KV cache."""

    FULL = "full"  # every token of the sequence
    SLIDING = "sliding"  # only the last ``sliding_window`` tokens
    NONE = "none"  # nothing: a layer without attention (e.g. a state-space mixer)


@dataclass(frozen=True)
class ModelShape:
    """Shape of a decoder-only model as the planner needs it.

    ``layer_kinds`` has one entry per layer; an empty tuple means every layer is FULL.
    MLA models set ``kv_lora_rank``: their attention layers cache one compressed latent per
    token instead of per-head K and V.  ``num_params`` / ``weight_bytes`` are exact counts when
    the source has them (a GGUF file); otherwise the planner estimates them from the shape.
    """

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    torch_dtype: str = "bfloat16"  # activations, and the KV cache under --kv-cache-dtype auto
    weight_dtype: str | None = None  # e.g. "fp8" for a quantized checkpoint; None: torch_dtype
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int | None = None
    sliding_window: int | None = None
    layer_kinds: tuple[LayerKind, ...] = ()
    # Mixture of experts (num_experts == 0: dense MLP in every layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # None: intermediate_size
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0  # leading layers that keep a dense MLP
    # Multi-head latent attention (DeepSeek V2/V3).
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_params: int | None = None
    weight_bytes: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise PlanError(f"{self.name}: {name} must be positive, got {getattr(self, name)}")
        if self.layer_kinds and len(self.layer_kinds) != self.num_layers:
            raise PlanError(
                f"{self.name}: {len(self.layer_kinds)} layer kinds for {self.num_layers} layers"
            )
        if LayerKind.SLIDING in self.kinds and not self.sliding_window:
            raise PlanError(f"{self.name}: sliding-window layers need sliding_window")
        if self.is_mla and self.qk_rope_head_dim <= 0:
            raise PlanError(f"{self.name}: an MLA model (kv_lora_rank) needs qk_rope_head_dim")

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """One LayerKind per layer (the empty default expanded to all FULL)."""
        return self.layer_kinds or (LayerKind.FULL,) * self.num_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def attention_name(self) -> str:
        """MHA / GQA / MQA / MLA: the name of the KV saving the model was built with."""
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"


def infer_layer_kinds(
    model_type: str,
    num_layers: int,
    sliding_window: int | None,
    *,
    layer_types: list[str] | None = None,
    sliding_window_pattern: int | None = None,
    use_sliding_window: bool = True,
    max_window_layers: int | None = None,
) -> tuple[LayerKind, ...]:
    """Which layers slide, from the config conventions of the model families that use windows.

    Why so many rules: the layout is spelled differently per family.  Newer configs list
    ``layer_types``; Gemma 2 alternates (even layers slide) without saying so; Gemma 3 and
    Cohere 2 give a period whose last layer is global; Qwen2 slides only layers at or after
    ``max_window_layers`` and only when ``use_sliding_window``; Mistral slides every layer.
    """
    if layer_types:
        return tuple(_kind_of_layer_type(name) for name in layer_types)
    if not sliding_window or not use_sliding_window:
        return ()
    if model_type == "gemma2" and not sliding_window_pattern:
        return tuple(LayerKind.SLIDING if i % 2 == 0 else LayerKind.FULL for i in range(num_layers))
    if sliding_window_pattern:
        period = sliding_window_pattern
        return tuple(
            LayerKind.FULL if (i + 1) % period == 0 else LayerKind.SLIDING
            for i in range(num_layers)
        )
    if max_window_layers is not None and model_type.startswith("qwen"):
        return tuple(
            LayerKind.SLIDING if i >= max_window_layers else LayerKind.FULL
            for i in range(num_layers)
        )
    return (LayerKind.SLIDING,) * num_layers


def _kind_of_layer_type(name: str) -> LayerKind:
    """Map a config.json ``layer_types`` entry; any non-attention mixer keeps no KV cache."""
    if name in ("full_attention", "attention", "global", "full"):
        return LayerKind.FULL
    if name in ("sliding_attention", "local", "sliding", "local_sliding"):
        return LayerKind.SLIDING
    return LayerKind.NONE
