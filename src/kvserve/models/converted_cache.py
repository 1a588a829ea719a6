"""A GGUF file's converted weights, kept once per machine.

Reading the embedded model's GGUF costs ~8 s a start on this machine: ~6 s in gguf-py's
metadata reader (its ~100,000 tokenizer strings, each a memory-mapped slice) and ~2.4 s
dequantizing.  The result (a ModelConfig and float32 tensors) is the same every time, so
the first load writes it to $KVSERVE_CACHE_DIR/models/<key>/ (config.json and
model.safetensors) and later loads read that in well under a second.

The key covers the file (resolved path, size, modification time) and the converting code
(kvserve's sources that read the metadata, dequantize, unpermute and fuse, and the `gguf`
package's version), so a changed file or a changed conversion converts again; storing a
file's new entry removes its older ones (~0.5 GB each for the embedded model).  Files under
MIN_CACHED_BYTES are not stored: they convert in a few seconds at most, and the tests write
many of them.  A cache that cannot be read or written costs only the conversion: loading
never fails because of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvserve.config import ModelConfig, cache_dir

logger = logging.getLogger(__name__)

MIN_CACHED_BYTES = 64 * 2**20  # above the tests' tiny float32 files (~25 MB)
_CONFIG, _WEIGHTS = "config.json", "model.safetensors"
# The files (in the kvserve package) whose code decides the converted config and values.
_CONVERTING_SOURCES = (
    "config.py", "formats/__init__.py", "formats/gguf_metadata.py", "models/gguf_loader.py",
    "models/checkpoint.py", "models/converted_cache.py",
)  # fmt: skip

Converted = tuple[ModelConfig, dict[str, torch.Tensor]]


def _file_part(path: Path) -> str:
    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]


def cache_key(path: Path) -> str:
    """<the file's path>-<its size and time, and the converting code>, as hex digests."""
    stat = path.stat()
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:{version('gguf')}".encode())
    package = Path(__file__).parent.parent
    for name in _CONVERTING_SOURCES:
        digest.update((package / name).read_bytes())
    return f"{_file_part(path)}-{digest.hexdigest()[:16]}"


def converted_dir(path: Path) -> Path:
    return cache_dir("models") / cache_key(path)


def load_converted(path: Path, convert: Callable[[Path], Converted]) -> Converted:
    """`convert(path)`, or what an earlier call stored for the same file and code."""
    if path.stat().st_size < MIN_CACHED_BYTES:
        return convert(path)
    directory = converted_dir(path)
    cached = _read(directory)
    if cached is not None:
        return cached
    config, weights = convert(path)
    _write(directory, config, weights)
    _remove_stale(directory)
    return config, weights


def _read(directory: Path) -> Converted | None:
    if not (directory / _CONFIG).is_file() or not (directory / _WEIGHTS).is_file():
        return None
    try:
        fields = json.loads((directory / _CONFIG).read_text())
        fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
        fields["layer_types"] = tuple(fields.get("layer_types", ()))
        config = ModelConfig(**fields)
        weights = load_file(directory / _WEIGHTS)
    except (OSError, ValueError, TypeError, KeyError, SafetensorError) as exc:
        logger.warning("converted weights in %s unreadable (%s); converting again", directory, exc)
        return None
    return config, weights


def _write(directory: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Written into a temporary sibling, then renamed: a reader sees all of it or none."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=directory.parent))
    except OSError:
        return  # a read-only home only costs the conversion next time
    try:
        (staging / _CONFIG).write_text(json.dumps(dataclasses.asdict(config)))
        save_file({name: t.contiguous() for name, t in weights.items()}, staging / _WEIGHTS)
        os.replace(staging, directory)
        size = (directory / _WEIGHTS).stat().st_size
        logger.info("converted weights stored in %s (%.0f MB): later starts read them from there",
                    directory, size / 1e6)  # fmt: skip
    except OSError:
        pass  # another process stored it first, or the disk is full: nothing is lost
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_stale(current: Path) -> None:
    """The same file's entries for an older version of it or of the converting code."""
    prefix = current.name.split("-")[0] + "-"
    for entry in current.parent.glob(prefix + "*"):
        if entry != current:
            shutil.rmtree(entry, ignore_errors=True)
