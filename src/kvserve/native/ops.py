"""Every entry point of the native library (csrc/), declared once, behind a typed wrapper.

`kernels()` is this process's library (built on first use, build.py); `Kernels(lib)` wraps
another build (benchmarks/kernel_ab.py times two).  Nothing else sets a function's `argtypes`
or `restype` (tests/unit/test_native_ops.py reads the tree for it).

The C code trusts its pointers: a tensor of another dtype, shape or stride is read as if it
were the expected one, past its end if need be.  So each wrapper checks what its kernel takes
on trust (dtype, shape, contiguity; not values such as block ids and lengths, which are the
callers' invariants) and raises ValueError naming the entry point and the tensors.  On the
path that passes that is one boolean expression a call, a few microseconds; the message is
worked out only on failure.  The three entry points that took 25-27 positional arguments take
one structure (structs.py); the others keep their few scalars.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

import torch

from kvserve.config import key_value_dtypes
from kvserve.native import build
from kvserve.native.build import KernelBuildError
from kvserve.native.kinds import (
    FP8_DTYPE,
    STORAGE_DTYPE,
    Kind,
    KVTensors,
    fp8_lookup_table,
    kind_of,
)
from kvserve.native.structs import (
    STRUCTURES,
    DecodeLayer,
    DecodeStepArgs,
    PagedDecodeArgs,
    PrefillArgs,
    Q8Layer,
    Q8StepArgs,
    layout,
)

logger = logging.getLogger(__name__)

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_LAYER = ctypes.POINTER(DecodeLayer)
# name: (result, argument types), for every entry point of the library; declared here only.
DECLARATIONS: dict[str, tuple[type, list[type]]] = {
    # attention/
    "paged_decode_attention": (_I32, [ctypes.POINTER(PagedDecodeArgs)]),
    "paged_decode_use_amx": (_I32, [_I32]),
    "prefill_attention_bf16": (_I32, [ctypes.POINTER(PrefillArgs)]),
    "kv_quantize_store": (_I32, [_P, _I32, _I64, _P, _P, _P, _I32, _I32, _I32, _I32, _P, _I32]),
    "kv_copy_store": (_I32, [_P, _I64, _P, _P, _I32, _I64, _I32]),
    # linear/ (linear_amx_set_stealing: AMX builds only)
    "linear_bf16_packed": (_I32, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I32]),
    "silu_gate_up_bf16_packed": (_I32, [_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I32]),
    "linear_packed_block_cols": (_I32, []),
    "linear_amx_set_stealing": (_I32, [_I32]),
    "linear_q8_f32": (_I32, [_P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I32]),
    "dequantize_q8_f32": (_I32, [_P, _P, _P, _I64, _I64, _I32]),
    "linear_q4_f32": (_I32, [_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I32]),
    # layer/ (decode_pre/between/post_attention, decode_step_layers: builds with a projection
    # kernel only, as decode_layer_available says)
    "decode_layer_available": (_I32, []),
    "decode_layer_work_bytes": (_I64, [_LAYER, _I64]),
    "decode_pre_attention": (_I32, [_LAYER, _P, _I64, _P, _P, _P, _P, _P, _P, _I32]),
    "decode_between_attentions": (_I32, [_LAYER, _LAYER, _P, _P, _I64, _I64, _P, _P, _P, _P,
                                         _P, _P, _I32]),
    "decode_post_attention": (_I32, [_LAYER, _P, _P, _I64, _I64, _P, _I32]),
    "decode_step_layers": (_I32, [ctypes.POINTER(DecodeStepArgs)]),
    "q8_step_work_floats": (_I64, [ctypes.POINTER(Q8Layer), _I64]),
    "decode_step_q8": (_I32, [ctypes.POINTER(Q8StepArgs)]),
    "silu_mul_bf16": (_I32, [_P, _I64, _P, _I64, _I64, _I64, _I32]),
    # sampling/
    "argmax_rows": (_I32, [_P, _I32, _I64, _I64, _I64, _P, _I32]),
    "top_p_thresholds": (_I32, [_P, _I64, _I64, _I64, _P, _P, _P, _I32]),
    "top_k_floors": (_I32, [_P, _I64, _I64, _I64, _P, _P, _P, _I32]),
    "draw_rows": (_I32, [_P, _I64, _I64, _I64, _P, _P, _P, _I32]),
    # runtime/
    "bind_omp_threads": (_I32, [_P, _I32]),
    "native_struct_size": (_I64, [_I32]),
    "native_struct_field": (ctypes.c_char_p, [_I32, _I32, ctypes.POINTER(_I64)]),
}  # fmt: skip

_F32_BF16 = (torch.float32, torch.bfloat16)
_F32, _BF16, _INT64 = torch.float32, torch.bfloat16, torch.int64


class NewRows(NamedTuple):
    """A decode step's new K/V rows, which the decode kernel stores before attending them."""

    key: torch.Tensor  # [B, Hkv, D] of the cache's dtype, each row's Hkv x D contiguous
    value: torch.Tensor
    slots: torch.Tensor  # [B] int64, contiguous


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _is(t: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """`t` is a contiguous tensor of `dtype` and `shape`."""
    return t is not None and t.dtype is dtype and t.shape == shape and t.is_contiguous()


def _uniform_caches(caches: Sequence[KVTensors], cache_shape: tuple[int, ...]) -> bool:
    """Every layer's cache stored as the first's (dtype and kv dtype), contiguous, of rows
    `cache_shape` ([block_size, kv_heads, head_dim]): what a one-call decode step reads."""
    key, kv_dtype = caches[0].key, caches[0].kv_dtype
    return all(
        c.kv_dtype == kv_dtype and c.key.dtype == c.value.dtype == key.dtype
        and c.key.shape[1:] == c.value.shape[1:] == cache_shape
        and c.key.is_contiguous() and c.value.is_contiguous()
        for c in caches
    )  # fmt: skip


def _step_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, m: int
) -> bool:
    """A decode step's int64 block tables [m, n], lengths [m] and slots [m], contiguous."""
    return (
        block_tables.dim() == 2 and _is(block_tables, _INT64, (m, block_tables.shape[1]))
        and _is(seq_lens, _INT64, (m,)) and _is(slots, _INT64, (m,))
    )  # fmt: skip


def _sink_pointer(cache: KVTensors, kind: Kind, num_kv_heads: int, dim: int) -> int | None:
    """The address of a 4-bit key cache's key sink (kv_quant.py), NULL without one; refused
    where it is not float32 [Hkv, D], contiguous."""
    sink = cache.key_sink
    if sink is None or kind != Kind.I4:
        return None
    if not _is(sink, _F32, (num_kv_heads, dim)):
        _refuse("paged_decode_attention", "a contiguous float32 key sink [Hkv, D]", key_sink=sink)
    return sink.data_ptr()


def _cache_pointers(caches: Sequence[KVTensors]) -> ctypes.Array[ctypes.c_void_p]:
    """Each layer's key, value, key scales and value scales addresses, in that order (NULL
    for no scales): a one-call decode step's `caches` argument (keep it alive through the
    call)."""
    tensors = [t for c in caches for t in (c.key, c.value, c.key_scale, c.value_scale)]
    return (ctypes.c_void_p * len(tensors))(*map(_ptr, tensors))


def _rows(t: torch.Tensor) -> bool:
    """[T, heads, dim] with each token's heads x dim values contiguous."""
    strides = t.stride()
    return len(strides) == 3 and strides[2] == 1 and strides[1] == t.shape[2]


def _scales(key: torch.Tensor | None, value: torch.Tensor | None, shape: torch.Size) -> bool:
    """Both 8-bit scales float32 [blocks, block_size, Hkv] of a cache of `shape`, contiguous."""
    return (
        key is not None and value is not None and key.dtype is value.dtype is _F32
        and key.shape == value.shape == shape[:3] and key.is_contiguous() and value.is_contiguous()
    )  # fmt: skip


def _row_width(kind: Kind, dim: int) -> int:
    """Elements of a cache row of `dim` values in `kind`'s storage: two 4-bit codes a byte."""
    return dim // 2 if kind is Kind.I4 else dim


def _refuse(entry: str, expected: str, **tensors: torch.Tensor | None) -> NoReturn:
    got = ", ".join(
        f"{name} {'None' if t is None else (tuple(t.shape), t.dtype, t.stride())}"
        for name, t in tensors.items()
    )
    raise ValueError(f"{entry}: expected {expected}; got {got}")


class Kernels:
    """The library's entry points, declared, behind typed wrappers that take tensors.  The
    threads are torch's (torch.get_num_threads() at each call).  Entry points a build may lack
    answer for themselves: `has_decode_layers`, `set_linear_stealing`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        """Declare `lib`'s functions; KernelBuildError where its argument structures are laid
        out otherwise than structs.py's (a field added, dropped, retyped or moved on one side
        only): checked here, as no call could tell."""
        for name, (result, arguments) in DECLARATIONS.items():
            function = getattr(lib, name, None)
            if function is not None:
                function.restype, function.argtypes = result, arguments
        for which, structure in enumerate(STRUCTURES):
            if _library_layout(lib, which) != layout(structure):
                raise KernelBuildError(
                    f"the library's {structure.__name__} is laid out as "
                    f"{_library_layout(lib, which)}, native/structs.py's as {layout(structure)}"
                )
        self.lib = lib

    # --- attention/ ------------------------------------------------------------------------

    def paged_decode(
        self,
        query: torch.Tensor,  # [B, H, D] float32, or bfloat16 (the kernel widens and rounds)
        out: torch.Tensor,  # as query
        cache: KVTensors,
        block_tables: torch.Tensor,  # [B, max_blocks] int64
        seq_lens: torch.Tensor,  # [B] int64: keys each sequence attends
        scale: float,
        lse: torch.Tensor | None = None,  # [B, H] float32: each head's log-sum-exp
        new_rows: NewRows | None = None,  # stored at their slots before they are attended
        prior: tuple[torch.Tensor, torch.Tensor] | None = None,  # [B, H, D], [B, H] float32
        window: int = 0,  # a sliding window: each sequence attends its last `window` keys
    ) -> None:
        """csrc/attention/paged_decode.c: each sequence's attention over its blocks, read in
        place; with `prior`, merged with attention over other keys by the log-sum-exps (lse
        is then not written).  With a `window`, the table entries of the blocks wholly before
        a sequence's last `window` keys are never read.  MemoryError when the kernel has no
        memory for its buffers."""
        key, value = cache.key, cache.value
        key_scale, value_scale = cache.key_scale, cache.value_scale
        q_shape, k_shape = query.shape, key.shape
        if len(q_shape) != 3 or len(k_shape) != 4:
            _refuse("paged_decode_attention", "query [B, H, D], caches [blocks, block_size, "
                    "Hkv, D]", query=query, key=key)  # fmt: skip
        (num_seqs, num_heads, dim), num_kv_heads = q_shape, k_shape[2]
        key_format, value_format = key_value_dtypes(cache.kv_dtype)
        kind, value_kind = kind_of(key.dtype, key_format), kind_of(value.dtype, value_format)
        # Written out (dtypes are singletons: `is`), as this runs once a layer and step.
        if not (
            (query.dtype is _F32 or query.dtype is _BF16) and out.dtype is query.dtype
            and out.shape == q_shape and query.is_contiguous() and out.is_contiguous()
            and k_shape[3] == _row_width(kind, dim) and num_heads % num_kv_heads == 0
            and value.shape[:3] == k_shape[:3] and value.shape[3] == _row_width(value_kind, dim)
            and key.is_contiguous() and value.is_contiguous()
            and (key_scale is value_scale is None or _scales(key_scale, value_scale, k_shape))
            and block_tables.dtype is _INT64 and block_tables.dim() == 2
            and block_tables.shape[0] == num_seqs and block_tables.is_contiguous()
            and seq_lens.dtype is _INT64 and seq_lens.shape == (num_seqs,)
            and seq_lens.is_contiguous()
            and (lse is None or _is(lse, _F32, (num_seqs, num_heads)))
            and 0 <= window < 2**31
        ):  # fmt: skip
            _refuse("paged_decode_attention", "contiguous query and out [B, H, D], float32 or "
                    "bfloat16; caches [blocks, block_size, Hkv, D] (H a multiple of Hkv) and "
                    "float32 scales [blocks, block_size, Hkv]; int64 tables [B, n] and lengths "
                    "[B]; float32 lse [B, H]; a window >= 0", query=query, out=out, key=key,
                    value=value,
                    key_scale=key_scale, value_scale=value_scale, block_tables=block_tables,
                    seq_lens=seq_lens, lse=lse)  # fmt: skip
        args = PagedDecodeArgs(
            query=query.data_ptr(), out=out.data_ptr(), key=key.data_ptr(), value=value.data_ptr(),
            key_scale=_ptr(key_scale), value_scale=_ptr(value_scale),
            lut=fp8_lookup_table(kind).data_ptr() if kind in FP8_DTYPE else None,
            block_tables=block_tables.data_ptr(), seq_lens=seq_lens.data_ptr(), lse=_ptr(lse),
            kind=kind, num_seqs=num_seqs, max_blocks=block_tables.shape[1],
            num_kv_heads=num_kv_heads, group=num_heads // num_kv_heads, dim=dim,
            block_size=key.shape[1], sm_scale=scale, num_threads=torch.get_num_threads(),
            io_bf16=query.dtype == _BF16, sliding_window=window, value_kind=value_kind,
            key_sink=_sink_pointer(cache, kind, num_kv_heads, dim),
        )  # fmt: skip
        if new_rows is not None:
            _set_new_rows(args, new_rows, key)
        if prior is not None:
            prior_out, prior_lse = prior
            if not (_is(prior_out, _F32, query.shape) and _is(prior_lse, _F32, query.shape[:2])):
                _refuse("paged_decode_attention", "a contiguous float32 prior [B, H, D] and "
                        "[B, H]", prior_out=prior_out, prior_lse=prior_lse)  # fmt: skip
            args.prior_out, args.prior_lse = prior_out.data_ptr(), prior_lse.data_ptr()
        if self.lib.paged_decode_attention(ctypes.byref(args)):
            raise MemoryError("paged decode attention: out of memory for its score buffer")

    def use_amx_decode(self, on: bool) -> bool:
        """Switch the decode kernel's AMX scores (bf16 and 8-bit caches; on by default where
        the CPU has AMX), for tests and benchmarks that compare the two paths; returns whether
        they were on (always False where the library was built without AMX)."""
        return bool(self.lib.paged_decode_use_amx(int(on)))

    def prefill_attention(
        self,
        query: torch.Tensor,  # [N, L, H, D] bfloat16, each token's H x D contiguous
        keys: torch.Tensor,  # [N, >= S, Hkv, D] bfloat16, or [1, slots, Hkv, D] with tables
        values: torch.Tensor,
        num_keys: int,  # S
        causal: bool,  # query t sees keys up to t + S - L
        scale: float,
        out: torch.Tensor,  # [N, L, H, D] contiguous: bfloat16, or float32
        lse: torch.Tensor | None = None,  # [N, L, H] float32, with a float32 out
        engine: int = 0,  # 0: AMX where permitted; 1: AVX512-BF16 vectors alone
        tables: torch.Tensor | None = None,  # [N, blocks] int64: keys read from a paged cache
        block_size: int = 0,  # the paged cache's, with tables
    ) -> bool:
        """csrc/attention/prefill_bf16.c; False where this build or CPU has no such kernel or
        the shapes do not fit it (nothing written).  MemoryError when out of memory."""
        if query.dim() != 4 or keys.dim() != 4:
            _refuse("prefill_attention_bf16", "query [N, L, H, D], keys [N, S, Hkv, D]",
                    query=query, keys=keys)  # fmt: skip
        num_seqs, num_query, num_heads, dim = query.shape
        if not (
            query.dtype == keys.dtype == values.dtype == _BF16
            and values.shape == keys.shape and keys.shape[3] == dim
            and query.stride(3) == keys.stride(3) == values.stride(3) == 1
            and query.stride(2) == keys.stride(2) == values.stride(2) == dim
            and out.dtype in _F32_BF16 and _is(out, out.dtype, query.shape)
            and (lse is None or (_is(lse, _F32, query.shape[:3]) and out.dtype == _F32))
            and (keys.shape[0] == num_seqs and keys.shape[1] >= num_keys if tables is None else
                 keys.shape[0] == 1 and tables.dim() == 2 and tables.shape[0] == num_seqs
                 and tables.dtype == _INT64 and tables.stride(1) == 1
                 and tables.shape[1] * block_size >= num_keys)
        ):  # fmt: skip
            _refuse("prefill_attention_bf16", "bfloat16 query [N, L, H, D] and keys and values "
                    "[N, >= S, Hkv, D] (or [1, slots, Hkv, D] and int64 tables [N, n]), each "
                    "token's heads contiguous; contiguous out [N, L, H, D], float32 with lse "
                    "[N, L, H]", query=query, keys=keys, values=values, out=out, lse=lse,
                    tables=tables)  # fmt: skip
        bf16_out = out.dtype == _BF16
        args = PrefillArgs(
            q=query.data_ptr(), q_stride=query.stride(1), q_batch=query.stride(0),
            k=keys.data_ptr(), k_stride=keys.stride(1), k_batch=keys.stride(0),
            v=values.data_ptr(), v_stride=values.stride(1), v_batch=values.stride(0),
            num_seqs=num_seqs, num_query=num_query, num_keys=num_keys, num_heads=num_heads,
            num_kv_heads=keys.shape[2], dim=dim, causal=int(causal), scale=scale,
            out_bf16=out.data_ptr() if bf16_out else None,
            out_f32=None if bf16_out else out.data_ptr(), lse=_ptr(lse), engine=engine,
            num_threads=torch.get_num_threads(), kv_table=_ptr(tables),
            table_stride=0 if tables is None else tables.stride(0), kv_block_size=block_size,
        )  # fmt: skip
        failed = self.lib.prefill_attention_bf16(ctypes.byref(args))
        if failed == 2:
            raise MemoryError("bf16 prefill attention: out of memory for its buffers")
        return not failed

    def kv_quantize_store(
        self,
        rows: torch.Tensor,  # [T, Hkv, D] float32 or bfloat16, each row contiguous
        cache: torch.Tensor,  # [slots, Hkv, D] codes of `kind` (D / 2 bytes for I4), contiguous
        scales: torch.Tensor | None,  # slots x Hkv float32 (int8, e4m3, int4), else None
        slots: torch.Tensor,  # [T] int64
        kind: Kind,
        sink: torch.Tensor | None = None,  # [Hkv, D] float32, contiguous: an I4 key sink
    ) -> None:
        """csrc/attention/kv_quantize.c: quantize and store in one pass (kv_quant.py's codes
        bit for bit)."""
        r_shape, c_shape = rows.shape, cache.shape
        if not (
            (rows.dtype is _F32 or rows.dtype is _BF16) and _rows(rows)
            and kind in (Kind.I8, Kind.E4M3, Kind.E5M2, Kind.I4)
            and cache.dtype is STORAGE_DTYPE[kind] and len(c_shape) == 3
            and c_shape[1] == r_shape[1]
            and c_shape[2] == _row_width(kind, r_shape[2])
            and cache.is_contiguous()
            and (scales is None if kind == Kind.E5M2 else scales is not None
                 and scales.dtype is _F32 and scales.is_contiguous()
                 and scales.numel() == c_shape[0] * c_shape[1])
            and slots.dtype is _INT64 and slots.shape == r_shape[:1] and slots.is_contiguous()
            and (sink is None or kind == Kind.I4 and _is(sink, _F32, r_shape[1:]))
        ):  # fmt: skip
            _refuse("kv_quantize_store", f"float32 or bfloat16 rows [T, Hkv, D] into a "
                    f"contiguous {kind.name} cache [slots, Hkv, D] (D / 2 for I4; contiguous "
                    "float32 scales, slots x Hkv, for I8, E4M3 and I4), int64 slots [T]",
                    rows=rows, cache=cache, scales=scales, slots=slots)  # fmt: skip
        num_tokens, heads, dim = rows.shape
        self.lib.kv_quantize_store(
            rows.data_ptr(), kind_of(rows.dtype), rows.stride(0), cache.data_ptr(),
            _ptr(scales), slots.data_ptr(), num_tokens, heads, dim, kind, _ptr(sink),
            torch.get_num_threads(),
        )  # fmt: skip

    def kv_copy_store(self, rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """rows [T, Hkv, D] (each contiguous) into a contiguous cache [slots, Hkv, D] of their
        dtype at slots [T] (int64), one copy a row (csrc/attention/kv_quantize.c)."""
        r_shape, c_shape = rows.shape, cache.shape
        if not (
            _rows(rows) and cache.dtype is rows.dtype and len(c_shape) == 3
            and c_shape[1] == r_shape[1] and c_shape[2] == r_shape[2] and cache.is_contiguous()
            and slots.dtype is _INT64 and slots.shape == r_shape[:1] and slots.is_contiguous()
        ):  # fmt: skip
            _refuse("kv_copy_store", "rows [T, Hkv, D] into a contiguous cache of their dtype, "
                    "int64 slots [T]", rows=rows, cache=cache, slots=slots)  # fmt: skip
        size = rows.element_size()
        self.lib.kv_copy_store(
            rows.data_ptr(), rows.stride(0) * size, cache.data_ptr(), slots.data_ptr(),
            rows.shape[0], rows.shape[1] * rows.shape[2] * size, torch.get_num_threads(),
        )  # fmt: skip

    # --- linear/ ---------------------------------------------------------------------------

    @staticmethod
    def _check_rows(entry: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """bfloat16 x [M, K] and out [M, N], each with contiguous rows."""
        if not (
            x.dim() == out.dim() == 2
            and x.shape[0] == out.shape[0]
            and x.dtype == out.dtype == _BF16
            and x.stride(1) == out.stride(1) == 1
        ):
            _refuse(entry, "bfloat16 x [M, K] and out [M, N], rows contiguous", x=x, out=out)

    def linear_packed(
        self,
        x: torch.Tensor,  # [M, K] bfloat16, rows contiguous; M a multiple of 16
        packed_weight: torch.Tensor,  # oneDNN's packed bf16 weight [N, K]
        bias: torch.Tensor | None,  # [N] bfloat16
        out: torch.Tensor,  # [M, N] bfloat16, rows contiguous
    ) -> bool:
        """csrc/linear/linear_amx.c (or linear_dot.c): x W^T + b over oneDNN's packed weight;
        False where it declines (the shapes, or a build or CPU without either kernel)."""
        self._check_rows("linear_bf16_packed", x, out)
        (m, k), n = x.shape, out.shape[1]
        if bias is not None and not _is(bias, _BF16, (n,)):
            _refuse("linear_bf16_packed", "a bfloat16 bias [N]", bias=bias, out=out)
        return not self.lib.linear_bf16_packed(
            x.data_ptr(), x.stride(0), torch.ops.mkldnn.data_ptr(packed_weight), _ptr(bias),
            out.data_ptr(), out.stride(0), m, n, k, torch.get_num_threads(),
        )  # fmt: skip

    def silu_gate_up_packed(
        self,
        x: torch.Tensor,  # [M, K] bfloat16, rows contiguous
        packed_weight: torch.Tensor,  # oneDNN's packed [Wg; Wu], [2 x features, K]
        out: torch.Tensor,  # [M, features] bfloat16, rows contiguous
    ) -> bool:
        """SiLU(x Wg^T) x (x Wu^T) in the projection kernel; False where it declines."""
        self._check_rows("silu_gate_up_bf16_packed", x, out)
        (m, k), features = x.shape, out.shape[1]
        return not self.lib.silu_gate_up_bf16_packed(
            x.data_ptr(), x.stride(0), torch.ops.mkldnn.data_ptr(packed_weight), out.data_ptr(),
            out.stride(0), m, features, k, torch.get_num_threads(),
        )  # fmt: skip

    def linear_q8(
        self,
        x: torch.Tensor,  # [M, K] float32, rows contiguous
        codes: torch.Tensor,  # [N, Kp] int8, contiguous; Kp = K rounded up to 32
        scales: torch.Tensor,  # [N, Kp / 32] float32, contiguous
        bias: torch.Tensor | None,  # [N] float32
        out: torch.Tensor,  # [M, N] float32, rows contiguous
    ) -> bool:
        """csrc/linear/linear_q8.c: x W^T + b with W = codes x their block's scale, dequantized
        in registers; False where it declines its arguments."""
        (m, k), n = x.shape, codes.shape[0]
        padded = -(-k // 32) * 32
        if not (
            x.dim() == out.dim() == 2 and x.dtype is out.dtype is _F32
            and x.stride(1) == out.stride(1) == 1 and out.shape == (m, n)
            and _is(codes, torch.int8, (n, padded)) and _is(scales, _F32, (n, padded // 32))
            and (bias is None or _is(bias, _F32, (n,)))
        ):  # fmt: skip
            _refuse("linear_q8_f32", "float32 x [M, K] and out [M, N] with contiguous rows, "
                    "contiguous int8 codes [N, K rounded up to 32], float32 scales [N, that / "
                    "32] and bias [N]", x=x, codes=codes, scales=scales, bias=bias,
                    out=out)  # fmt: skip
        return not self.lib.linear_q8_f32(
            x.data_ptr(), x.stride(0), codes.data_ptr(), scales.data_ptr(), _ptr(bias),
            out.data_ptr(), out.stride(0), m, n, k, torch.get_num_threads(),
        )  # fmt: skip

    def linear_q4(
        self,
        x: torch.Tensor,  # [M, K] float32, rows contiguous; K a multiple of 32, M <= 64
        codes: torch.Tensor,  # [N, K / 2] uint8, contiguous
        scales: torch.Tensor,  # [N, K / 32] float32, contiguous
        mins: torch.Tensor,  # [N, K / 32] float32, contiguous
        bias: torch.Tensor | None,  # [N] float32
        out: torch.Tensor,  # [M, N] float32, rows contiguous
    ) -> bool:
        """csrc/linear/linear_q4.c: x W^T + b with W = scale x code + min per block of 32,
        x rounded to 8-bit blocks (integer dot products); False where it declines its
        arguments (K not whole blocks, over 64 rows)."""
        (m, k), n = x.shape, codes.shape[0]
        if not (
            x.dim() == out.dim() == 2 and x.dtype is out.dtype is _F32
            and x.stride(1) == out.stride(1) == 1 and out.shape == (m, n) and k % 2 == 0
            and _is(codes, torch.uint8, (n, k // 2))
            and all(_is(t, _F32, (n, k // 32)) for t in (scales, mins))
            and (bias is None or _is(bias, _F32, (n,)))
        ):  # fmt: skip
            _refuse("linear_q4_f32", "float32 x [M, K] and out [M, N] with contiguous rows, "
                    "contiguous uint8 codes [N, K / 2], float32 scales and mins [N, K / 32] "
                    "and bias [N]", x=x, codes=codes, scales=scales, mins=mins, bias=bias,
                    out=out)  # fmt: skip
        return not self.lib.linear_q4_f32(
            x.data_ptr(), x.stride(0), codes.data_ptr(), scales.data_ptr(), mins.data_ptr(),
            _ptr(bias), out.data_ptr(), out.stride(0), m, n, k, torch.get_num_threads(),
        )  # fmt: skip

    def dequantize_q8(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """out [N, K] float32 (contiguous) = codes [N, K rounded up to 32] int8 times their
        blocks' scales [N, that / 32] float32 (csrc/linear/linear_q8.c)."""
        (n, k), padded = out.shape, codes.shape[1]
        if not (
            _is(out, _F32, (n, k)) and padded == -(-k // 32) * 32
            and _is(codes, torch.int8, (n, padded)) and _is(scales, _F32, (n, padded // 32))
        ):  # fmt: skip
            _refuse("dequantize_q8_f32", "contiguous int8 codes [N, K rounded up to 32], float32 "
                    "scales [N, that / 32] and out [N, K]", codes=codes, scales=scales,
                    out=out)  # fmt: skip
        self.lib.dequantize_q8_f32(codes.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k,
                                   torch.get_num_threads())  # fmt: skip

    def packed_block_cols(self) -> int:
        """The packed layout's column block the projection kernels read (32 for AMX, 64 for
        AVX512-BF16 without it), 0 where this build has neither."""
        return int(self.lib.linear_packed_block_cols())

    def set_linear_stealing(self, on: bool) -> bool | None:
        """The AMX projections' threads take each other's column blocks (on, the default) or
        keep static halves (benchmarks, tests); whether it was on, or None without AMX."""
        function = getattr(self.lib, "linear_amx_set_stealing", None)
        return None if function is None else bool(function(int(on)))

    # --- layer/ ----------------------------------------------------------------------------

    def has_decode_layers(self) -> bool:
        """This build has csrc/layer/decode_layer.c's kernels (a projection kernel is built)."""
        return bool(self.lib.decode_layer_available())

    @staticmethod
    def decode_layers(layers: Sequence[DecodeLayer]) -> ctypes.Array[DecodeLayer]:
        """The layers' descriptions, contiguous, for `decode_step`."""
        return (DecodeLayer * len(layers))(*layers)

    def _work(self, rows: int, *layers: DecodeLayer) -> torch.Tensor:
        """The scratch a layer kernel's call needs at `rows` rows (the most of `layers`')."""
        size = max(self.lib.decode_layer_work_bytes(ctypes.byref(x), rows) for x in layers)
        return torch.empty(size, dtype=torch.uint8)

    @staticmethod
    def _check_layer(
        entry: str,
        layer: DecodeLayer,
        hidden: torch.Tensor,  # [mp, hidden]
        cos: torch.Tensor,  # [mp, 1, D / 2] or [mp, D / 2]
        outputs: tuple[torch.Tensor, ...],  # q [mp, H, D], k [mp, Hkv, D], qkv, or none
        attn: torch.Tensor | None = None,  # [m <= mp, H x D] or [m, H, D]
        *others: torch.Tensor,  # sin, another layer's view of the same buffers
    ) -> None:
        """The layer kernels' tensors: bfloat16, contiguous, of the layer's shape."""
        rows, heads, kv_heads = hidden.shape[0], layer.num_heads, layer.num_kv_heads
        dim = layer.head_dim
        shapes = ((rows, heads, dim), (rows, kv_heads, dim), (rows, (heads + 2 * kv_heads) * dim))
        tensors = (hidden, cos, *outputs, *others) + (() if attn is None else (attn,))
        if not (
            hidden.shape == (rows, layer.hidden) and rows % 16 == 0
            and cos.shape[0] == rows and cos.numel() == rows * (dim // 2)
            and all(t.dtype == _BF16 and t.is_contiguous() for t in tensors)
            and all(t.shape == shape for t, shape in zip(outputs, shapes, strict=False))
            and (attn is None
                 or (attn.shape[0] <= rows and attn.numel() == attn.shape[0] * heads * dim))
        ):  # fmt: skip
            _refuse(entry, f"contiguous bfloat16 hidden [16 n, {layer.hidden}], cos and sin "
                    f"[rows, {dim // 2}], q [rows, {heads}, {dim}], k [rows, {kv_heads}, {dim}], "
                    f"qkv [rows, {(heads + 2 * kv_heads) * dim}], attn [m <= rows, {heads * dim}]",
                    hidden=hidden, cos=cos, attn=attn,
                    **{f"tensor_{i}": t for i, t in enumerate((*outputs, *others))})  # fmt: skip

    def decode_pre_attention(
        self,
        layer: DecodeLayer,
        hidden: torch.Tensor,  # [mp, hidden] bfloat16: the embeddings; mp a multiple of 16
        cos: torch.Tensor,  # [mp, 1, D / 2] (or [mp, D / 2])
        sin: torch.Tensor,
        q: torch.Tensor,  # [mp, H, D] out
        k: torch.Tensor,  # [mp, Hkv, D] out
        qkv: torch.Tensor,  # [mp, (H + 2 Hkv) D] out: v stays in it
    ) -> bool:
        """RMSNorm, QKV projection and RoPE of the first layer (csrc/layer/decode_layer.c);
        False where a projection declined its shapes."""
        self._check_layer("decode_pre_attention", layer, hidden, cos, (q, k, qkv), None, sin)
        work, rows = self._work(hidden.shape[0], layer), hidden.shape[0]
        return not self.lib.decode_pre_attention(
            ctypes.byref(layer), hidden.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(),
            q.data_ptr(), k.data_ptr(), qkv.data_ptr(), work.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    def decode_between_attentions(
        self,
        layer: DecodeLayer,
        next_layer: DecodeLayer,
        hidden: torch.Tensor,  # [mp, hidden], updated in place
        attn: torch.Tensor,  # [m, H x D] bfloat16: the layer's attention
        cos: torch.Tensor,
        sin: torch.Tensor,
        q: torch.Tensor,  # the next layer's, as decode_pre_attention's
        k: torch.Tensor,
        qkv: torch.Tensor,
    ) -> bool:
        """One layer's post-attention work and the next one's pre-attention work."""
        entry = "decode_between_attentions"
        self._check_layer(entry, layer, hidden, cos, (), attn, sin)
        self._check_layer(entry, next_layer, hidden, cos, (q, k, qkv))
        work, rows = self._work(hidden.shape[0], layer, next_layer), hidden.shape[0]
        return not self.lib.decode_between_attentions(
            ctypes.byref(layer), ctypes.byref(next_layer), hidden.data_ptr(), attn.data_ptr(),
            attn.shape[0], rows, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(),
            qkv.data_ptr(), work.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    def decode_post_attention(
        self, layer: DecodeLayer, hidden: torch.Tensor, attn: torch.Tensor
    ) -> bool:
        """The last layer's post-attention work; `hidden` updated in place."""
        rows = hidden.shape[0]
        if not (
            hidden.shape == (rows, layer.hidden)
            and rows % 16 == 0
            and hidden.dtype == attn.dtype == _BF16
            and hidden.is_contiguous()
            and attn.is_contiguous()
            and attn.shape[0] <= rows
            and attn.numel() == attn.shape[0] * layer.num_heads * layer.head_dim
        ):
            _refuse("decode_post_attention", f"contiguous bfloat16 hidden [16 n, {layer.hidden}] "
                    "and attn [m <= rows, H x D]", hidden=hidden, attn=attn)  # fmt: skip
        work = self._work(rows, layer)
        return not self.lib.decode_post_attention(
            ctypes.byref(layer), hidden.data_ptr(), attn.data_ptr(), attn.shape[0], rows,
            work.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    def decode_step(
        self,
        layers: ctypes.Array[DecodeLayer],  # decode_layers(): every layer, of one shape
        caches: Sequence[KVTensors],  # each layer's, of one kind: bf16 or 8-bit
        hidden: torch.Tensor,  # [mp, hidden]: the embeddings in, the last layer's out
        cos: torch.Tensor,
        sin: torch.Tensor,
        q: torch.Tensor,  # buffers as decode_pre_attention's, reused by every layer
        k: torch.Tensor,
        qkv: torch.Tensor,
        attn: torch.Tensor,  # [m, H x D]: m decodes
        block_tables: torch.Tensor,  # [m, max_blocks] int64
        seq_lens: torch.Tensor,  # [m] int64: keys past the shared prefix
        slots: torch.Tensor,  # [m] int64: each decode's new row's slot
        scale: float,
        prefix_table: torch.Tensor | None = None,  # [prefix_blocks] int64: a shared prefix
        prior_out: torch.Tensor | None = None,  # [m, H, D] float32: its attention's buffers
        prior_lse: torch.Tensor | None = None,  # [m, H] float32
    ) -> bool:
        """csrc/layer/decode_layer.c's decode_step_layers: every layer of a decode step,
        attention included, in one call; False where a projection declined its shapes or an
        attention had no memory for its buffers."""
        entry, first, m, rows = "decode_step_layers", layers[0], attn.shape[0], hidden.shape[0]
        self._check_layer(entry, first, hidden, cos, (q, k, qkv), attn, sin)
        key, kv_dtype = caches[0].key, caches[0].kv_dtype
        kind = kind_of(key.dtype, kv_dtype)
        cache_shape = (key.shape[1], first.num_kv_heads, first.head_dim)
        prefix_blocks = 0 if prefix_table is None else prefix_table.shape[0]
        if not (
            len(caches) == len(layers) and kind in (Kind.BF16, Kind.I8, Kind.E4M3, Kind.E5M2)
            and _uniform_caches(caches, cache_shape)
            and _step_tables(block_tables, seq_lens, slots, m)
            and (prefix_table is None or (
                kind == Kind.BF16 and _is(prefix_table, _INT64, (prefix_blocks,))
                and _is(prior_out, _F32, (m, *q.shape[1:]))
                and _is(prior_lse, _F32, (m, q.shape[1]))))
        ):  # fmt: skip
            _refuse(entry, f"a contiguous bf16 or 8-bit cache a layer, [blocks, {cache_shape}]; "
                    "int64 tables [m, n], lengths and slots [m]; with a prefix (bf16 caches), "
                    "its int64 table [n] and float32 buffers [m, H, D] and [m, H]", key=key,
                    block_tables=block_tables, seq_lens=seq_lens, slots=slots,
                    prefix_table=prefix_table, prior_out=prior_out,
                    prior_lse=prior_lse)  # fmt: skip
        cache_array = _cache_pointers(caches)  # alive through the call
        work = self._work(rows, first)
        args = DecodeStepArgs(
            layers=ctypes.addressof(layers), caches=ctypes.addressof(cache_array),
            hidden=hidden.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), q=q.data_ptr(),
            k=k.data_ptr(), qkv=qkv.data_ptr(), attn=attn.data_ptr(), work=work.data_ptr(),
            block_tables=block_tables.data_ptr(), seq_lens=seq_lens.data_ptr(),
            slots=slots.data_ptr(), prefix_table=_ptr(prefix_table), prior_out=_ptr(prior_out),
            prior_lse=_ptr(prior_lse), m=m, mp=rows, num_layers=len(layers), kind=kind,
            max_blocks=block_tables.shape[1], block_size=cache_shape[0],
            prefix_blocks=prefix_blocks, sm_scale=scale, threads=torch.get_num_threads(),
        )  # fmt: skip
        return not self.lib.decode_step_layers(ctypes.byref(args))

    @staticmethod
    def q8_layers(layers: Sequence[Q8Layer]) -> ctypes.Array[Q8Layer]:
        """The layers' descriptions, contiguous, for `decode_step_q8`."""
        return (Q8Layer * len(layers))(*layers)

    def decode_step_q8(
        self,
        layers: ctypes.Array[Q8Layer],  # q8_layers(): every layer, of one shape
        caches: Sequence[KVTensors],  # each layer's, of one kind: float32 or 8-bit
        hidden: torch.Tensor,  # [m, hidden] float32: the embeddings in, the last layer's out
        cos: torch.Tensor,  # [m, D / 2] float32 (or [m, 1, D / 2])
        sin: torch.Tensor,
        block_tables: torch.Tensor,  # [m, max_blocks] int64
        seq_lens: torch.Tensor,  # [m] int64: keys each decode attends, its new one included
        slots: torch.Tensor,  # [m] int64: each decode's new row's slot
        scale: float,
    ) -> bool:
        """csrc/layer/decode_step_q8.c: every layer of a float32 decode step over 8-bit
        weights, attention included, in one call; False where a projection declined its
        shapes or an attention had no memory for its buffers."""
        first, m = layers[0], hidden.shape[0]
        key, kv_dtype = caches[0].key, caches[0].kv_dtype
        kind = kind_of(key.dtype, kv_dtype)
        cache_shape = (key.shape[1], first.num_kv_heads, first.head_dim)
        if not (
            len(caches) == len(layers) and kind in (Kind.F32, Kind.I8, Kind.E4M3, Kind.E5M2)
            and _is(hidden, _F32, (m, first.hidden))
            and all(_is(t, _F32, t.shape) and t.numel() == m * (first.head_dim // 2)
                    for t in (cos, sin))
            and _uniform_caches(caches, cache_shape)
            and _step_tables(block_tables, seq_lens, slots, m)
        ):  # fmt: skip
            _refuse("decode_step_q8", f"contiguous float32 hidden [m, {first.hidden}], cos and "
                    f"sin [m, {first.head_dim // 2}]; a contiguous float32 or 8-bit cache a "
                    f"layer, [blocks, {cache_shape}]; int64 tables [m, n], lengths and slots [m]",
                    hidden=hidden, cos=cos, key=key, block_tables=block_tables,
                    seq_lens=seq_lens, slots=slots)  # fmt: skip
        cache_array = _cache_pointers(caches)  # alive through the call
        work = torch.empty(self.lib.q8_step_work_floats(ctypes.byref(first), m), dtype=_F32)
        lut = fp8_lookup_table(kind) if kind in FP8_DTYPE else None
        args = Q8StepArgs(
            layers=ctypes.addressof(layers), caches=ctypes.addressof(cache_array),
            hidden=hidden.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
            work=work.data_ptr(), lut=_ptr(lut), block_tables=block_tables.data_ptr(),
            seq_lens=seq_lens.data_ptr(), slots=slots.data_ptr(), m=m, num_layers=len(layers),
            kind=kind, max_blocks=block_tables.shape[1], block_size=cache_shape[0],
            sm_scale=scale, threads=torch.get_num_threads(),
        )  # fmt: skip
        return not self.lib.decode_step_q8(ctypes.byref(args))

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> bool:
        """SiLU(gate) x up for rows [M, 2n] bfloat16 (gate, then up) into out [M, n], each with
        contiguous rows (csrc/layer/silu_mul.c); False where the build has no AVX512-BF16."""
        self._check_rows("silu_mul_bf16", gate_up, out)
        rows, n = out.shape
        if gate_up.shape[1] != 2 * n:
            _refuse("silu_mul_bf16", "gate_up [M, 2n] for out [M, n]", gate_up=gate_up, out=out)
        return not self.lib.silu_mul_bf16(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), rows, n,
            torch.get_num_threads(),
        )  # fmt: skip

    # --- sampling/ -------------------------------------------------------------------------

    def argmax_rows(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[r] = index of row r's maximum (torch's on ties and NaNs): x [rows, cols]
        float32 or bfloat16, each row contiguous; out [rows] int64 (csrc/sampling/)."""
        if not (
            x.dim() == 2 and (x.dtype is _F32 or x.dtype is _BF16) and x.stride(1) == 1
            and _is(out, _INT64, x.shape[:1])
        ):  # fmt: skip
            _refuse("argmax_rows", "float32 or bfloat16 x [rows, cols], rows contiguous; int64 "
                    "out [rows]", x=x, out=out)  # fmt: skip
        rows, cols = x.shape
        self.lib.argmax_rows(x.data_ptr(), kind_of(x.dtype), rows, cols, x.stride(0),
                             out.data_ptr(), torch.get_num_threads())  # fmt: skip

    @staticmethod
    def _check_probs(
        entry: str, probs: torch.Tensor, rows: dict[str, tuple[torch.Tensor | None, torch.dtype]]
    ) -> None:
        """probs [n, cols] float32 with contiguous rows; each of `rows` [n] of its dtype,
        contiguous (the optional ones may be None)."""
        n = probs.shape[0]
        if not (
            probs.dim() == 2
            and probs.dtype == _F32
            and probs.stride(1) == 1
            and all(t is None or _is(t, dtype, (n,)) for t, dtype in rows.values())
        ):
            wanted = ", ".join(f"{name} [rows] {dtype}" for name, (_, dtype) in rows.items())
            _refuse(entry, f"float32 probs [rows, cols], rows contiguous; {wanted}",
                    probs=probs, **{name: t for name, (t, _) in rows.items()})  # fmt: skip

    def top_p_thresholds(
        self,
        probs: torch.Tensor,  # [rows, cols] float32
        top_p: torch.Tensor,  # [rows] float32
        within: torch.Tensor | None,  # [rows] float32: look only at probabilities >= it
        threshold: torch.Tensor,  # [rows] float32 out
    ) -> bool:
        """Each row's nucleus threshold by selection (csrc/sampling/sample_rows.c); False
        when out of memory for its scratch rows."""
        self._check_probs("top_p_thresholds", probs, {"top_p": (top_p, _F32),
                          "within": (within, _F32), "threshold": (threshold, _F32)})  # fmt: skip
        return not self.lib.top_p_thresholds(
            probs.data_ptr(), probs.shape[0], probs.shape[1], probs.stride(0), top_p.data_ptr(),
            _ptr(within), threshold.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    def top_k_floors(
        self,
        probs: torch.Tensor,  # [rows, cols] float32
        top_k: torch.Tensor,  # [rows] int64
        floor: torch.Tensor,  # [rows] float32 out: the k-th largest probability
        kept: torch.Tensor,  # [rows] float32 out: the mass at or above it
    ) -> bool:
        """Each row's top-k floor and kept mass by selection; False when out of memory."""
        self._check_probs("top_k_floors", probs, {"top_k": (top_k, _INT64),
                          "floor": (floor, _F32), "kept": (kept, _F32)})  # fmt: skip
        return not self.lib.top_k_floors(
            probs.data_ptr(), probs.shape[0], probs.shape[1], probs.stride(0), top_k.data_ptr(),
            floor.data_ptr(), kept.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    def draw_rows(
        self,
        probs: torch.Tensor,  # [rows, cols] float32
        floor: torch.Tensor | None,  # [rows] float32: probabilities below it count as 0
        uniforms: torch.Tensor,  # [rows] float64 in [0, 1)
        out: torch.Tensor,  # [rows] int64 out
    ) -> bool:
        """One draw a row by inverting its cumulative distribution; False when out of memory."""
        self._check_probs("draw_rows", probs, {"floor": (floor, _F32),
                          "uniforms": (uniforms, torch.float64), "out": (out, _INT64)})  # fmt: skip
        return not self.lib.draw_rows(
            probs.data_ptr(), probs.shape[0], probs.shape[1], probs.stride(0), _ptr(floor),
            uniforms.data_ptr(), out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    # --- runtime/ --------------------------------------------------------------------------

    def bind_omp_threads(self, cpus: Sequence[int]) -> bool:
        """Pin the calling thread's OpenMP team, thread i on cpus[i]; False where that failed
        (a team of another size, or a CPU refused)."""
        array = (ctypes.c_int * len(cpus))(*cpus)
        return not self.lib.bind_omp_threads(array, len(cpus))


def _library_layout(lib: ctypes.CDLL, which: int) -> tuple[int, list[tuple[str, int]]]:
    """(size, [(field, offset), ...]) of the library's structure `which` (runtime/abi.c)."""
    fields, offset = [], ctypes.c_int64()
    while (name := lib.native_struct_field(which, len(fields), ctypes.byref(offset))) is not None:
        fields.append((name.decode(), offset.value))
    return lib.native_struct_size(which), fields


def _set_new_rows(args: PagedDecodeArgs, rows: NewRows, key_cache: torch.Tensor) -> None:
    """The decode's rows to store first, into its arguments (checked)."""
    k, v = rows.key, rows.value
    shape = (args.num_seqs, *key_cache.shape[2:])
    if not (
        k.shape == v.shape == shape
        and k.dtype == v.dtype == key_cache.dtype
        and _rows(k)
        and _rows(v)
        and _is(rows.slots, _INT64, (args.num_seqs,))
    ):
        _refuse("paged_decode_attention", f"new rows {shape} of the cache's dtype, each row "
                "contiguous, and int64 slots [B]", key=k, value=v, slots=rows.slots)  # fmt: skip
    size = k.element_size()
    args.new_key, args.new_value = k.data_ptr(), v.data_ptr()
    args.new_key_stride_bytes, args.new_value_stride_bytes = k.stride(0) * size, v.stride(0) * size
    args.new_slots = rows.slots.data_ptr()


@functools.cache
def kernels() -> Kernels:
    """This process's library, built on first use; KernelBuildError (or OSError) where it
    cannot be built or loaded here."""
    return Kernels(build.load_library())


@functools.cache
def available() -> bool:
    """True when the library builds and loads here; where not, logs why (once) and the callers
    keep torch's paths."""
    try:
        kernels()
    except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
        logger.warning("native library unavailable, using torch's paths: %s", exc)
        return False
    return True


def kernels_or_none() -> Kernels | None:
    """kernels(), or None where available() is False."""
    return kernels() if available() else None
