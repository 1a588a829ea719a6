"""Build and load kvserve's C kernels for the CPU (csrc/*.c) with the system C compiler.

The kernel is compiled once per source version, compiler and instruction set into
~/.cache/kvserve/kernels (override with KVSERVE_CACHE_DIR), in about a second, and loaded with
ctypes: no torch headers, no build step at install time.  When no compiler is found the build
fails with a message and callers fall back to the reference backend.

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
from collections.abc import Callable
from pathlib import Path

# Imported for its side effect: torch loads its OpenMP runtime (libgomp.so.1) before the
# kernel is loaded, so the kernel's libgomp.so.1 dependency binds to that same runtime and
# shares torch's threads instead of starting a second pool.
import torch  # noqa: F401

from kvserve.config import cache_dir

logger = logging.getLogger(__name__)

_SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_decode.c",
        "kv_quantize.c",
        "omp_affinity.c",
        "argmax_rows.c",
        "sample_rows.c",
        "silu_mul.c",
        "prefill_bf16.c",
        "linear_amx.c",
        "linear_dot.c",
        "decode_layer.c",
    )
)
# Included by the sources: part of the library's identity (its cache name), not compiled alone.
_HEADERS = tuple(
    Path(__file__).parent / "csrc" / name
    for name in ("vec_exp.h", "amx_tiles.h", "entry_points.h", "block_runs.h")
)
_FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-ffp-contract=fast",
    # Let the dot products vectorize (reassociation) without -ffast-math's process-wide
    # flush-to-zero, which a shared library must not switch on.
    "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
)  # fmt: skip


class KernelBuildError(RuntimeError):
    """The C kernel could not be compiled or loaded here."""


def kernel_cache_dir() -> Path:
    return cache_dir("kernels")


@functools.cache
def load_paged_decode() -> ctypes.CDLL:
    """The compiled paged-decode library (built on first use); KernelBuildError if impossible."""
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
    logger.info("compiling the CPU paged-attention kernel into %s", path)
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
    """A content key: source, compiler, flags, machine type and ISA features."""
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in (*_SOURCES, *_HEADERS)))
    digest.update(" ".join((compiler, *_FLAGS, platform.machine())).encode())
    digest.update(features.encode())
    return f"paged_decode-{digest.hexdigest()[:16]}.so"


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
    cmd = [compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(output), "-lm"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise KernelBuildError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")
    os.chmod(output, 0o700)


def _open(path: Path) -> ctypes.CDLL:
    """dlopen and declare the entry point; OSError or AttributeError when it is not a library
    with that symbol."""
    lib = ctypes.CDLL(str(path))
    fn = lib.paged_decode_attention
    ptr, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    fn.argtypes = [ptr] * 7 + [i32] + [ptr] * 2 + [i32] * 6 + [f32, i32, ptr, i32]
    fn.argtypes += [ptr, ptr, ctypes.c_int64, ctypes.c_int64, ptr]  # new K/V rows stored
    fn.argtypes += [ptr, ptr]  # attention over other keys merged in
    fn.restype = i32
    lib.bind_omp_threads.argtypes, lib.bind_omp_threads.restype = [ptr, i32], i32
    store = lib.kv_quantize_store
    store.argtypes = [ptr, i32, ctypes.c_int64, ptr, ptr, ptr] + [i32] * 5
    store.restype = i32
    copy_store = lib.kv_copy_store
    copy_store.argtypes = [ptr, ctypes.c_int64, ptr, ptr, i32, ctypes.c_int64, i32]
    copy_store.restype = i32
    argmax = lib.argmax_rows
    argmax.argtypes = [ptr, i32] + [ctypes.c_int64] * 3 + [ptr, i32]
    argmax.restype = i32
    top_p = lib.top_p_thresholds
    top_p.argtypes = [ptr] + [ctypes.c_int64] * 3 + [ptr, ptr, ptr, i32]
    top_p.restype = i32
    top_k = lib.top_k_floors
    top_k.argtypes = [ptr] + [ctypes.c_int64] * 3 + [ptr, ptr, ptr, i32]
    top_k.restype = i32
    draw = lib.draw_rows
    draw.argtypes = [ptr] + [ctypes.c_int64] * 3 + [ptr, ptr, ptr, i32]
    draw.restype = i32
    silu_mul = lib.silu_mul_bf16
    silu_mul.argtypes = [ptr, ctypes.c_int64, ptr] + [ctypes.c_int64] * 3 + [i32]
    silu_mul.restype = i32
    lib.paged_decode_use_amx.argtypes, lib.paged_decode_use_amx.restype = [i32], i32
    return lib


def use_amx_decode(on: bool) -> bool:
    """Switch the decode kernel's AMX scores (bf16 caches, on by default where the CPU has
    AMX) for tests and benchmarks that compare the two paths; returns whether AMX was on (always
    False where the kernel was built without it)."""
    return bool(load_paged_decode().paged_decode_use_amx(int(on)))


@functools.cache
def paged_decode_available() -> bool:
    """True when the kernel builds and loads here (logs why not, once)."""
    try:
        load_paged_decode()
    except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU paged-attention kernel unavailable, using the reference: %s", exc)
        return False
    return True


def kernels_or_none() -> ctypes.CDLL | None:
    """The kernel library, or None where it cannot be built here (why is logged once): for
    the callers that fall back to torch (K/V stores, the greedy argmax)."""
    return load_paged_decode() if paged_decode_available() else None


def kernel_function(name: str, argtypes: list[type]) -> Callable[..., int] | None:
    """The library's function `name`, with its C argument types and an int result, or None
    where the library cannot be built here or was built without it (some functions exist only
    where the compiler targets their instructions, AMX for one)."""
    kernels = kernels_or_none()
    function = getattr(kernels, name, None) if kernels is not None else None
    if function is None:
        return None
    function.restype = ctypes.c_int
    function.argtypes = argtypes
    return function
