"""The native library's build cache: keyed by the instruction set, private (0700), and a cached
library is loaded only when it is a regular file of ours that nobody else can write; a corrupt,
foreign or writable one is replaced by a fresh build.

One real gcc build per module (`built`); the other tests replace the compiler with a copy of
that library (`fake_compiler`) so they test the cache's decisions, not gcc."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from kvserve.native import build, ops

COMPILER = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler here")
FEATURES = "-march= test\n-mavx2 [enabled]"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A real build through the cache (compiler, flags, rename, mode)."""
    directory = tmp_path_factory.mktemp("cache") / "kernels"
    lib = build.load_kernel(directory, COMPILER, FEATURES)
    assert lib.paged_decode_attention is not None
    path = directory / build.library_name(COMPILER, FEATURES)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700 and os.listdir(directory) == [path.name]
    return path


@pytest.fixture
def fake_compiler(monkeypatch, built) -> list[Path]:
    """Builds become copies of the real library; returns the directories built in."""
    builds: list[Path] = []

    def compile_copy(compiler: str, output: Path) -> None:
        builds.append(output.parent)
        shutil.copyfile(built, output)
        os.chmod(output, 0o700)

    monkeypatch.setattr(build, "_compile", compile_copy)
    return builds


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    return build.kernel_cache_dir()


def load(cache: Path):
    return build.load_kernel(cache, COMPILER, FEATURES)


def cached_path(cache: Path) -> Path:
    return cache / build.library_name(COMPILER, FEATURES)


def assert_rebuilt(path: Path, built: Path) -> None:
    """`path` now holds a fresh build: a private regular file equal to the real library."""
    assert build.untrusted_reason(path) is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert path.read_bytes() == built.read_bytes()


def test_the_cache_dir_follows_kvserve_cache_dir_and_is_private(cache, tmp_path, fake_compiler):
    assert cache == tmp_path / "kernels"
    load(cache)
    assert fake_compiler == [cache] and os.listdir(cache) == [cached_path(cache).name]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert Path(load(cache)._name) == cached_path(cache)  # a cache hit: no second build
    assert len(fake_compiler) == 1


def test_an_existing_cache_dir_of_ours_is_tightened_to_0700(cache, fake_compiler):
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    load(cache)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_the_key_changes_with_the_instruction_set(cache, fake_compiler, monkeypatch):
    a = build.library_name(COMPILER, "-march= skylake-avx512\n-mavx512bf16 [disabled]")
    b = build.library_name(COMPILER, "-march= sapphirerapids\n-mavx512bf16 [enabled]")
    assert a != b
    answers = iter(["-march= x86-64-v3", "-march= x86-64-v4", "-march= x86-64-v4"])
    monkeypatch.setattr(build, "isa_features", lambda compiler: next(answers))
    monkeypatch.setenv("CC", COMPILER)
    for _ in range(3):  # load_library without its once-per-process cache
        build.load_library.__wrapped__()
    assert len(fake_compiler) == 2 and len(os.listdir(cache)) == 2  # v4 built once


def test_isa_features_resolve_march_native():
    features = build.isa_features(COMPILER)
    assert "-march=" in features or "flags" in features
    assert build.isa_features("/nonexistent/cc") == build._cpuinfo_features()


def test_a_corrupt_library_is_rebuilt(cache, fake_compiler, built):
    cache.mkdir(mode=0o700)
    path = cached_path(cache)
    path.write_bytes(b"\x7fELF truncated")
    os.chmod(path, 0o700)
    load(cache)
    assert fake_compiler == [cache]
    assert_rebuilt(path, built)


def test_a_library_without_the_symbol_is_rebuilt(cache, fake_compiler, built, tmp_path):
    """It did load (dlopen keeps it): the rebuild must not get that handle back by name."""
    source = tmp_path / "other.c"
    source.write_text("int something_else(void) { return 1; }\n")
    cache.mkdir(mode=0o700)
    path = cached_path(cache)
    subprocess.run([COMPILER, "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    os.chmod(path, 0o700)
    lib = load(cache)
    assert lib.paged_decode_attention is not None and fake_compiler == [cache]
    assert_rebuilt(path, built)


@pytest.mark.parametrize("mode", [0o720, 0o702, 0o777])
def test_a_group_or_world_writable_library_is_rebuilt(cache, fake_compiler, built, mode):
    cache.mkdir(mode=0o700)
    path = cached_path(cache)
    shutil.copyfile(built, path)
    os.chmod(path, mode)
    assert "writable by group or others" in build.untrusted_reason(path)
    load(cache)
    assert fake_compiler == [cache]
    assert_rebuilt(path, built)


def test_a_symlink_is_not_followed(cache, fake_compiler, built):
    cache.mkdir(mode=0o700)
    path = cached_path(cache)
    path.symlink_to(built)
    assert build.untrusted_reason(path) == "it is not a regular file"
    load(cache)
    assert fake_compiler == [cache] and not path.is_symlink()
    assert_rebuilt(path, built)


def test_a_library_owned_by_someone_else_is_rebuilt(cache, fake_compiler, built, monkeypatch):
    """As root: chown to nobody (65534).  Otherwise pretend to be another user: then the cache
    directory is foreign too, and the build goes to a private temporary directory."""
    cache.mkdir(mode=0o700)
    path = cached_path(cache)
    shutil.copyfile(built, path)
    os.chmod(path, 0o700)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        assert build.untrusted_reason(path) == "it is owned by uid 65534, not 0"
        load(cache)
        assert fake_compiler == [cache] and path.stat().st_uid == 0
        assert_rebuilt(path, built)
    else:
        monkeypatch.setattr(build.os, "getuid", lambda: os.geteuid() + 1)
        load(cache)
        assert len(fake_compiler) == 1 and fake_compiler[0] != cache
        assert not fake_compiler[0].exists()  # the private build directory is gone


def test_a_foreign_cache_dir_is_not_used(tmp_path, fake_compiler, built):
    """A symlinked cache directory (someone else's place) is never trusted: a private one-off
    directory is built in and removed once the library is loaded."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copyfile(built, elsewhere / build.library_name(COMPILER, FEATURES))
    link = tmp_path / "kernels"
    link.symlink_to(elsewhere)
    lib = build.load_kernel(link, COMPILER, FEATURES)
    assert len(fake_compiler) == 1 and fake_compiler[0] not in (link, elsewhere)
    assert not fake_compiler[0].exists()  # removed once loaded ...
    assert lib.paged_decode_attention is not None  # ... and the library still works


def test_a_file_that_cannot_be_removed_is_left_and_the_build_goes_elsewhere(
    cache, fake_compiler, monkeypatch
):
    cache.mkdir(mode=0o700)
    path = cached_path(cache)
    path.write_bytes(b"not a library")
    os.chmod(path, 0o700)
    monkeypatch.setattr(build, "_try_remove", lambda p: False)
    lib = load(cache)
    assert lib.paged_decode_attention is not None and path.read_bytes() == b"not a library"
    assert len(fake_compiler) == 1 and fake_compiler[0] != cache


@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64-v2"])
def test_the_kernels_build_for_cpus_without_avx512(tmp_path, target):
    """The sources compile and link for an AVX2-only CPU (AMD Zen 3, Intel before Skylake-SP)
    and a plain SSE4 one: each AVX-512 path sits behind its own guard.  A guard written as
    `#ifdef` on a macro defined as 0 made the whole library fail to build there, which left
    those CPUs on the reference backend's paths without a word."""
    flags = [f"-march={target}" if flag == "-march=native" else flag
             for flag in build.FLAGS]  # fmt: skip
    output = tmp_path / "lib.so"
    result = subprocess.run(
        build.compile_command(COMPILER, build.CSRC, build.SOURCES, output, flags),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (
        "paged_decode_attention"
        in subprocess.run(
            ["nm", "-D", str(output)], capture_output=True, text=True, check=True
        ).stdout
    )
    if target == "x86-64-v2":  # no AVX2: linear_q8.c's portable loops, against the reference
        _check_portable_q8(ops.Kernels(ctypes.CDLL(str(output))))


def _check_portable_q8(kernels: ops.Kernels) -> None:
    from kvserve.models.quantized_linear import dequantize_q8, quantize_q8

    gen = torch.Generator().manual_seed(0)
    for n, k, m in ((33, 70, 1), (40, 64, 5)):
        codes, scales = quantize_q8(torch.randn(n, k, generator=gen))
        x, out = torch.randn(m, k, generator=gen), torch.empty(m, n)
        assert kernels.linear_q8(x, codes, scales, None, out)
        want = x @ dequantize_q8(codes, scales, k).T
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-4)
