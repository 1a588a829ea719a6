"""Checkpoint loading: a GGUF file, a Hugging Face directory, or the embedded default.

Everything ends in a ``Checkpoint`` (checkpoint.py): a ModelConfig plus float32 tensors under
*our* parameter names (fused ``qkv_proj`` and ``gate_up_proj``), so the model never sees a file
format.  The two loaders are imported when needed (the GGUF one pulls in the `gguf` package).
"""

from __future__ import annotations

from kvserve.models.checkpoint import (  # noqa: F401  (re-exported: the loader's public names)
    Checkpoint,
    model_config_from_hf,
)
from kvserve.models.paths import (  # noqa: F401  (re-exported: the loader's public names)
    EMBEDDED_NAME,
    EMBEDDED_PACKAGE,
    ModelLoadError,
    embedded_model_path,
    resolve_model_path,
)


def load_checkpoint(model: str | None = None) -> Checkpoint:
    """The one entry point: a path or nothing -> Checkpoint."""
    path = resolve_model_path(model)
    if path.is_dir():
        from kvserve.models import hf_loader

        config, weights = hf_loader.load_hf_directory(path)
        name = path.name
    else:
        from kvserve.models import gguf_loader

        config, weights = gguf_loader.load_gguf(path)
        name = EMBEDDED_NAME if model is None else path.stem
    return Checkpoint(config=config, weights=weights, path=path, name=name)
