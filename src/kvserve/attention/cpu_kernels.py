"""Build and load kvserve's C kernels for the CPU (csrc/*.c) with the system C compiler.

The kernel is compiled once per machine and source version into ~/.cache/kvserve/kernels
(override with KVSERVE_CACHE_DIR), in about a second, and loaded with ctypes: no torch headers,
no build step at install time.  When no compiler is found the build fails with a message and
callers fall back to the reference backend.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# Imported for its side effect: torch loads its OpenMP runtime (libgomp.so.1) before the
# kernel is loaded, so the kernel's libgomp.so.1 dependency binds to that same runtime and
# shares torch's threads instead of starting a second pool.
import torch  # noqa: F401

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-ffp-contract=fast",
    # Let the dot products vectorize (reassociation) without -ffast-math's process-wide
    # flush-to-zero, which a shared library must not switch on.
    "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
)  # fmt: skip


class KernelBuildError(RuntimeError):
    """The C kernel could not be compiled or loaded here."""


def kernel_cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    return Path(root) / "kernels"


def _library_path(compiler: str) -> Path:
    digest = hashlib.sha256(_SOURCE.read_bytes())
    digest.update(" ".join((compiler, *_FLAGS, platform.machine(), platform.node())).encode())
    return kernel_cache_dir() / f"paged_decode-{digest.hexdigest()[:16]}.so"


def _compile(compiler: str, target: Path) -> None:
    """Compile to a temporary name, then rename: concurrent processes never load half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise KernelBuildError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_paged_decode() -> ctypes.CDLL:
    """The compiled paged-decode library (built on first use); KernelBuildError if impossible."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise KernelBuildError("no C compiler (gcc or cc) on PATH")
    path = _library_path(compiler)
    if not path.exists():
        logger.info("compiling the CPU paged-attention kernel into %s", path)
        _compile(compiler, path)
    lib = ctypes.CDLL(str(path))
    fn = lib.paged_decode_attention
    ptr, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    fn.argtypes = [ptr] * 7 + [i32] + [ptr] * 2 + [i32] * 6 + [f32, i32]
    fn.restype = i32
    return lib


@functools.cache
def paged_decode_available() -> bool:
    """True when the kernel builds and loads here (logs why not, once)."""
    try:
        load_paged_decode()
    except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU paged-attention kernel unavailable, using the reference: %s", exc)
        return False
    return True
