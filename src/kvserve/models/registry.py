"""Architecture name -> model class.  Llama, Mistral and Qwen2 share one implementation; they
differ only in config values (QKV bias, RoPE scaling, tied embeddings)."""

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
}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def normalize_architecture(name: str) -> str | None:
    """Our family name for an architecture string, or None when unsupported."""
    return _ALIASES.get(name.lower())


def get_model_class(architecture: str) -> type:
    """The nn.Module class for a (normalized) architecture name."""
    from kvserve.models.llama import LlamaForCausalLM

    if architecture not in {"llama", "mistral", "qwen2"}:
        raise UserInputError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return LlamaForCausalLM
