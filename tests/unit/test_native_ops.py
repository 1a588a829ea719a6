"""The native library's declarations (native/ops.py): each entry point is declared there and
nowhere else, the storage kinds agree with the C header, the build compiles every C file, and
the wrappers refuse tensors the C code would misread instead of handing it their pointers."""

from __future__ import annotations

import ast
import ctypes
import re
from pathlib import Path

import pytest
import torch

import kvserve
from kvserve.native import build, ops
from kvserve.native.build import KernelBuildError
from kvserve.native.kinds import Kind, fp8_lookup_table, kind_of
from kvserve.native.structs import STRUCTURES, DecodeStepArgs, layout

REPO = Path(__file__).parents[2]
OPS = Path(kvserve.__file__).parent / "native" / "ops.py"


def _declarations(path: Path) -> list[str]:
    """Where a file sets a ctypes function's argtypes or restype (an assignment to that
    attribute, or a setattr with that name)."""
    names = {"argtypes", "restype"}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(element, ast.Attribute) and element.attr in names:
                    found.append(f"{path}:{node.lineno}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in names
        ):
            found.append(f"{path}:{node.lineno}")  # fmt: skip
    return found


def test_entry_points_are_declared_in_native_ops_only():
    files = [p for d in ("src", "tests", "benchmarks") for p in (REPO / d).rglob("*.py")]
    assert OPS in files and _declarations(OPS)  # the check sees ops.py's own declarations
    elsewhere = [hit for p in files if p != OPS for hit in _declarations(p)]
    assert not elsewhere, f"argtypes/restype set outside native/ops.py: {elsewhere}"


def test_the_kind_enum_is_the_c_header_s():
    header = (build.CSRC / "common" / "kinds.h").read_text()
    body = re.search(r"enum kv_kind \{([^}]*)\}", header)
    assert body is not None
    in_c = {name.removeprefix("KV_"): int(value)
            for name, value in re.findall(r"(KV_\w+)\s*=\s*(\d+)", body.group(1))}  # fmt: skip
    assert in_c == {kind.name: kind.value for kind in Kind}


def test_no_c_file_holds_a_kind_as_a_number():
    """Kinds are spelt KV_*: a literal compared with a kind (`kind == 3`) is how the codes
    drifted apart before."""
    pattern = re.compile(r"\b(src_kind|out_kind|kind)\s*[!=]=\s*\d")
    hits = [f"{p.name}: {line.strip()}" for p in build.CSRC.rglob("*.[ch]")
            for line in p.read_text().splitlines() if pattern.search(line)]  # fmt: skip
    assert not hits


def test_the_build_compiles_every_c_file_and_hashes_every_header():
    assert set(build.SOURCES) == set(build.CSRC.glob("*/*.c"))
    assert set(build.HEADERS) == set(build.CSRC.glob("*/*.h"))
    assert not list(build.CSRC.glob("*.[ch]"))  # every file in the directory of its kind


def test_storage_kinds_of_dtypes():
    assert kind_of(torch.bfloat16) == Kind.BF16
    assert kind_of(torch.int8, "int8") == Kind.I8
    assert kind_of(torch.uint8, "fp8_e5m2") == Kind.E5M2
    for kind in (Kind.E4M3, Kind.E5M2):
        table = fp8_lookup_table(kind)
        assert table.shape == (256,) and table[0] == 0 and table.dtype == torch.float32


needs_library = pytest.mark.skipif(not ops.available(), reason="no C compiler here")


@needs_library
def test_the_library_s_structures_are_laid_out_as_structs_py_s():
    """What Kernels() checks at load, and that the check reads every field."""
    lib = ops.kernels().lib
    for which, structure in enumerate(STRUCTURES):
        size, fields = ops._library_layout(lib, which)
        assert (size, fields) == layout(structure)
        assert [name for name, _ in fields] == [name for name, _ in structure._fields_]
    assert lib.native_struct_size(len(STRUCTURES)) == -1


def test_a_library_laid_out_otherwise_is_refused(monkeypatch):
    """A field that one side lacks (here: ctypes' mirror of the decode step's arguments) is
    an error at load, not a call that reads the wrong bytes."""
    if not ops.available():
        pytest.skip("no C compiler here")

    class Shorter(ctypes.Structure):
        _fields_ = DecodeStepArgs._fields_[:-1]

    monkeypatch.setattr(ops, "STRUCTURES", (*STRUCTURES[:3], Shorter))
    with pytest.raises(KernelBuildError, match="Shorter"):
        ops.Kernels(ops.kernels().lib)


class _Cache:
    def __init__(self, dtype: torch.dtype = torch.bfloat16, kv_dtype: str = "auto") -> None:
        self.key = torch.zeros(4, 16, 2, 32, dtype=dtype)
        self.value = torch.zeros(4, 16, 2, 32, dtype=dtype)
        self.key_scale = self.value_scale = self.key_sink = None
        self.kv_dtype = kv_dtype


@needs_library
def test_the_decode_wrapper_refuses_what_the_kernel_would_misread():
    kernels, cache = ops.kernels(), _Cache()
    query = torch.zeros(3, 4, 32)
    tables, lens = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, dtype=torch.int64)
    out = torch.empty_like(query)
    kernels.paged_decode(query, out, cache, tables, lens, 0.1)  # fits: runs
    assert torch.equal(out, torch.zeros_like(out))  # V rows of zeros
    with pytest.raises(ValueError, match="paged_decode_attention"):
        kernels.paged_decode(query, out, cache, tables.int(), lens, 0.1)  # int32 tables
    with pytest.raises(ValueError, match="paged_decode_attention"):
        kernels.paged_decode(query.transpose(0, 1).contiguous().transpose(0, 1), out, cache,
                             tables, lens, 0.1)  # fmt: skip
    with pytest.raises(ValueError, match="paged_decode_attention"):
        kernels.paged_decode(torch.zeros(3, 5, 32), torch.zeros(3, 5, 32), cache, tables, lens,
                             0.1)  # 5 heads over 2 KV heads  # fmt: skip
    rows = torch.zeros(3, 2, 32)  # float32 rows for a bf16 cache
    with pytest.raises(ValueError, match="new rows"):
        kernels.paged_decode(query, out, cache, tables, lens, 0.1,
                             new_rows=ops.NewRows(rows, rows, lens))  # fmt: skip


@needs_library
def test_the_store_and_sampling_wrappers_refuse_wrong_dtypes():
    kernels = ops.kernels()
    codes = torch.zeros(64, 2, 32, dtype=torch.int8)
    rows = torch.randn(3, 2, 32)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="kv_quantize_store"):  # int8 needs its scales
        kernels.kv_quantize_store(rows, codes, None, slots, Kind.I8)
    scales = torch.ones(64, 2)
    kernels.kv_quantize_store(rows, codes, scales, slots, Kind.I8)
    assert codes[:3].abs().amax() == 127
    with pytest.raises(ValueError, match="kv_copy_store"):
        kernels.kv_copy_store(rows, torch.zeros(64, 2, 32, dtype=torch.bfloat16), slots)
    with pytest.raises(ValueError, match="argmax_rows"):
        kernels.argmax_rows(torch.zeros(2, 5), torch.empty(2, dtype=torch.int32))
    probs = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="uniforms"):
        kernels.draw_rows(probs, None, torch.zeros(2), torch.empty(2, dtype=torch.int64))
