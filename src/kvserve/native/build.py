"""Build and load kvserve's native library (csrc/*/*.c) with the system C compiler.

The library is compiled once per source version, compiler and instruction set into
~/.cache/kvserve/kernels (override with KVSERVE_CACHE_DIR), in about a second, and loaded with
ctypes: no torch headers, no build step at install time.  When no compiler is found the build
fails with a message and callers fall back to torch (ops.available()).  Its entry points are
declared in ops.py, and only there.

Loading a shared object runs its code, so the cache is treated as untrusted until checked: the
directory is created 0700 and must be a real directory owned by this user; a library is loaded
only when it is a regular file owned by this user and not group/world-writable (nobody else can
then swap it between the check and the load).  A library that fails these checks, or that
does not load (corrupt, truncated, missing symbol), is removed and rebuilt; where the cache
directory itself is not ours, the kernel is built into a fresh private temporary directory.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

# Imported for its side effect: torch loads its OpenMP runtime (libgomp.so.1) before the
# kernel is loaded, so the kernel's libgomp.so.1 dependency binds to that same runtime and
# shares torch's threads instead of starting a second pool.
import torch  # noqa: F401

from kvserve.config import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# One directory per kind of entry point; common/ holds what several kinds include.
SOURCES = tuple(
    CSRC / name
    for name in (
        "attention/paged_decode.c",
        "attention/prefill_bf16.c",
        "attention/kv_quantize.c",
        "linear/linear_amx.c",
        "linear/linear_dot.c",
        "linear/linear_q8.c",
        "linear/linear_q4.c",
        "layer/decode_layer.c",
        "layer/decode_step_q8.c",
        "layer/silu_mul.c",
        "sampling/argmax_rows.c",
        "sampling/sample_rows.c",
        "runtime/omp_affinity.c",
        "runtime/abi.c",
    )
)
# Included by the sources: part of the library's identity (its cache name), not compiled alone.
HEADERS = tuple(sorted(CSRC.glob("*/*.h")))
FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-ffp-contract=fast",
    # Let the dot products vectorize (reassociation) without -ffast-math's process-wide
    # flush-to-zero, which a shared library must not switch on.
    "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
)  # fmt: skip


class KernelBuildError(RuntimeError):
    """The native library could not be compiled or loaded here."""


def kernel_cache_dir() -> Path:
    return cache_dir("kernels")


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled library (built on first use); KernelBuildError if impossible.  Its
    functions are undeclared: ops.kernels() declares them."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise KernelBuildError("no C compiler (gcc or cc) on PATH")
    return load_kernel(kernel_cache_dir(), compiler, isa_features(compiler))


def load_kernel(directory: Path, compiler: str, features: str) -> ctypes.CDLL:
    """Load the library cached in `directory` for these ISA `features`, building it when it is
    missing, untrusted or unloadable.  Not cached: tests call it on their own directories."""
    directory, private = _private_dir(directory)
    path = directory / library_name(compiler, features)
    if os.path.lexists(path):
        problem = untrusted_reason(path)
        if problem is None:
            try:
                return _open(path)
            except (OSError, AttributeError) as exc:
                problem = f"it does not load ({exc})"
        logger.warning("discarding the cached kernel %s: %s; rebuilding it", path, problem)
        if not _try_remove(path):
            directory, private = Path(tempfile.mkdtemp(prefix="kvserve-kernels-")), True
            path = directory / path.name
    logger.info("compiling the native library into %s", path)
    try:
        return _build_and_open(compiler, path)
    finally:
        if private:  # a one-off directory: the loaded mapping outlives the file on POSIX
            shutil.rmtree(directory, ignore_errors=True)


def isa_features(compiler: str) -> str:
    """What -march=native means to this compiler on this CPU, for the cache key: a library built
    for other features may crash with SIGILL (a home directory shared by several machines, a VM
    moved to another host).  `-Q --help=target` resolves -march=native exactly (the -march
    value and every -m flag on or off) for one ~10-80 ms subprocess per process; compilers
    without it (clang) fall back to /proc/cpuinfo's CPU model and flags."""
    try:
        result = subprocess.run(
            [compiler, "-march=native", "-Q", "--help=target"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if result.returncode == 0 and "-march=" in result.stdout:
            return result.stdout
    except (OSError, subprocess.SubprocessError):
        pass
    return _cpuinfo_features()


def _cpuinfo_features() -> str:
    """The first CPU's model name and sorted flags; the machine type where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return platform.machine()
    wanted = {"model name", "flags", "Features", "CPU part"}  # x86 and arm64 spellings
    seen: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            seen.setdefault(key.strip(), " ".join(sorted(value.split())))
    return "\n".join(f"{k}: {v}" for k, v in sorted(seen.items())) or platform.machine()


def library_name(compiler: str, features: str) -> str:
    """A content key: sources and headers, compiler, flags, machine type and ISA features."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.relative_to(CSRC).as_posix().encode() + b"\0" + path.read_bytes())
    digest.update(" ".join((compiler, *FLAGS, platform.machine())).encode())
    digest.update(features.encode())
    return f"kvserve_native-{digest.hexdigest()[:16]}.so"


def _private_dir(directory: Path) -> tuple[Path, bool]:
    """(directory, False) once it exists as a real directory of ours with mode 0700 (an older
    0755 one is tightened); else (a new private temporary directory, True)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode):
            problem = "it is not a directory (a symlink?)"
        elif st.st_uid != os.getuid():
            problem = f"it is owned by uid {st.st_uid}, not {os.getuid()}"
        else:
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.chmod(directory, 0o700)
            return directory, False
    except OSError as exc:
        problem = str(exc)
    fallback = Path(tempfile.mkdtemp(prefix="kvserve-kernels-"))
    logger.warning("kernel cache %s is not private (%s); building in %s", directory, problem,
                   fallback)  # fmt: skip
    return fallback, True


def untrusted_reason(path: Path) -> str | None:
    """Why the file at `path` must not be loaded, or None: it must be a regular file (not a
    symlink) owned by this user and not writable by group or others."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _try_remove(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove %s (%s)", path, exc)
        return False
    return True


def _build_and_open(compiler: str, target: Path) -> ctypes.CDLL:
    """Compile to a temporary name beside `target`, load it from there, then rename it into
    place.  So concurrent processes never load half a file, a build that does not load never
    enters the cache, and the handle is a new one even when this process already loaded a
    broken library under the target's name (dlopen hands back the handle of a loaded path)."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        _compile(compiler, Path(tmp))
        try:
            lib = _open(Path(tmp))
        except (OSError, AttributeError) as exc:
            raise KernelBuildError(f"the freshly built kernel does not load: {exc}") from exc
        os.replace(tmp, target)
        return lib
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compile(compiler: str, output: Path) -> None:
    """The linker creates its output with the umask's mode: set 0700 (owner only)."""
    cmd = compile_command(compiler, CSRC, SOURCES, output)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise KernelBuildError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")
    os.chmod(output, 0o700)


def compile_command(
    compiler: str, root: Path, sources: Sequence[Path], output: Path, flags: Sequence[str] = FLAGS
) -> list[str]:
    """The compiler's command line for `sources` (includes are relative to `root`, the csrc
    directory): benchmarks/kernel_ab.py builds another revision's sources with it."""
    return [compiler, *flags, f"-I{root}", *map(str, sources), "-o", str(output), "-lm"]


def _open(path: Path) -> ctypes.CDLL:
    """dlopen, and check that it is this library; OSError or AttributeError when it is not a
    library with its entry point."""
    lib = ctypes.CDLL(str(path))
    lib.paged_decode_attention  # noqa: B018 - AttributeError where the symbol is missing
    return lib
