"""Architecture name -> model class.  Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (text) share one
implementation; they differ only in config values (QKV bias, RoPE scaling, tied embeddings,
sliding windows, q/k norms, Gemma's norms and activation)."""

from __future__ import annotations

from kvserve.errors import UserInputError

# Hugging Face `architectures` / `model_type` / GGUF `general.architecture` -> our family name.
_ALIASES = {
    "llamaforcausallm": "llama",
    "llama": "llama",
    "mistralforcausallm": "mistral",
    "mistral": "mistral",
    "qwen2forcausallm": "qwen2",
    "qwen2": "qwen2",
    "qwen3forcausallm": "qwen3",
    "qwen3": "qwen3",
    "gemma3forcausallm": "gemma3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # GGUF's general.architecture (HF's multimodal model_type: see below)
}
# Gemma3ForConditionalGeneration (the multimodal checkpoints) is not served: its text weights
# live under other names (model.language_model.*), next to a vision tower.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
FAMILIES = frozenset(_ALIASES.values())


def normalize_architecture(name: str) -> str | None:
    """Our family name for an architecture string, or None when unsupported."""
    return _ALIASES.get(name.lower())


def get_model_class(architecture: str) -> type:
    """The nn.Module class for a (normalized) architecture name."""
    from kvserve.models.llama import LlamaForCausalLM

    if architecture not in FAMILIES:
        raise UserInputError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return LlamaForCausalLM
