"""The capacity plan: weights, KV budget and concurrency of one model on one GPU type.

    budget per GPU   = gpu_memory_utilization x GPU memory - weights / TP
    num_blocks       = budget // bytes_per_block            (the engine's start-up count)
    max sequences    = sequences of --context tokens whose whole blocks fit in the budget

Activations are not subtracted: the engine profiles them at start-up, so its budget comes
out somewhat lower than the planner's.  Pass the engine's logged KV memory to
``engine_kv_capacity`` to check its numbers exactly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

from kvserve.config import GPU_MEMORY_UTILIZATION_DEFAULT, CacheConfig
from kvserve.kv.spec import cdiv, kv_cache_spec
from kvserve.planner.layers import KVLayout, kv_layout
from kvserve.planner.model import ModelShape, PlanError
from kvserve.planner.weights import (
    estimate_num_params,
    resolve_weight_dtype,
    weight_bytes,
    weight_bytes_per_gpu,
)

# The KV dtypes every plan compares side by side ("auto" is the model's 16/32-bit dtype).
KV_DTYPES_COMPARED = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "k8v4")


@dataclass(frozen=True)
class KVCapacity:
    """What the engine logs at start-up for a given KV memory and max_model_len."""

    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int  # kv_cache_memory // bytes_per_block
    num_tokens: int  # num_blocks x block_size
    blocks_per_seq: int  # ceil(max_model_len / block_size)
    max_concurrency: float  # num_blocks / blocks_per_seq for a uniform model


def kv_capacity(layout: KVLayout, kv_cache_memory: int, max_model_len: int) -> KVCapacity:
    """Blocks and concurrency of ``kv_cache_memory`` bytes, as the engine counts them.

    A uniform model gives exactly ``num_blocks / blocks_per_seq``; with sliding layers a
    sequence needs fewer bytes than blocks_per_seq full blocks, which the ratio of bytes
    accounts for.
    """
    num_blocks = max(0, kv_cache_memory) // layout.bytes_per_block
    per_seq = layout.block_bytes_per_sequence(max_model_len)
    return KVCapacity(
        bytes_per_token=layout.bytes_per_token,
        bytes_per_block=layout.bytes_per_block,
        num_blocks=num_blocks,
        num_tokens=num_blocks * layout.block_size,
        blocks_per_seq=cdiv(max_model_len, layout.block_size),
        max_concurrency=num_blocks * layout.bytes_per_block / per_seq,
    )


def engine_kv_capacity(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    model_dtype: str,
    *,
    block_size: int,
    kv_cache_dtype: str,
    kv_cache_memory: int,
    max_model_len: int,
    tensor_parallel_size: int = 1,
) -> KVCapacity:
    """The engine's start-up numbers for a standard-attention model, from its config values.

    Uses ``kv_cache_spec`` directly, like the engine:
    num_blocks = kv_cache_memory // spec.bytes_per_block and
    max_concurrency = num_blocks / ceil(max_model_len / block_size).
    """
    spec = kv_cache_spec(
        num_layers,
        num_kv_heads,
        head_dim,
        kv_cache_dtype,
        model_dtype,
        block_size,
        tensor_parallel_size,
    )
    num_blocks = spec.num_blocks_in(kv_cache_memory)
    blocks_per_seq = spec.num_blocks_for_tokens(max_model_len)
    return KVCapacity(
        bytes_per_token=spec.bytes_per_token,
        bytes_per_block=spec.bytes_per_block,
        num_blocks=num_blocks,
        num_tokens=num_blocks * block_size,
        blocks_per_seq=blocks_per_seq,
        max_concurrency=num_blocks / blocks_per_seq,
    )


@dataclass(frozen=True)
class DtypePlan:
    """Every KV number of the plan for one KV cache dtype (per GPU under TP)."""

    kv_cache_dtype: str  # as on the command line: auto, bfloat16, fp8_e4m3, ..., int4
    storage_dtype: str  # what is stored: float16, fp8_e4m3, ...
    bytes_per_token: int
    bytes_per_block: int
    bytes_per_sequence: int  # token-exact at the context length, windows applied
    bytes_for_batch: int  # bytes_per_sequence x batch
    block_bytes_per_sequence: int  # whole blocks, as the engine allocates
    num_blocks: int  # budget // bytes_per_block
    max_num_seqs: int  # sequences of the context length that fit at once
    max_concurrency: float  # the engine's log line: num_blocks / blocks per sequence
    max_model_len: int | None  # longest single sequence that fits; None: no limit
    batch_fits: bool
    formula: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """The whole answer of `kvserve plan`; ``dtypes`` holds one entry per compared KV dtype."""

    model_name: str
    source: str
    architecture: str
    attention: str  # MHA / GQA / MQA / MLA
    num_params: int
    params_exact: bool
    weight_dtype: str
    weight_bytes: int
    weight_bytes_per_gpu: int
    gpu_name: str
    gpu_memory: int
    gpu_memory_utilization: float
    usable_memory: int  # utilization x GPU memory
    kv_budget: int  # usable - weights per GPU; negative when the weights do not fit
    context_len: int
    batch_size: int
    block_size: int
    tensor_parallel_size: int
    kv_cache_dtype: str  # the selected one
    dtypes: tuple[DtypePlan, ...]
    notes: tuple[str, ...]

    @property
    def selected(self) -> DtypePlan:
        """The row of --kv-cache-dtype."""
        return next(d for d in self.dtypes if d.kv_cache_dtype == self.kv_cache_dtype)


@dataclass(frozen=True)
class PlanInputs:
    """What the user asked for, validated; the CLI builds it from its flags."""

    gpu_name: str
    gpu_memory: int
    context_len: int | None = None  # None: the model's max_position_embeddings
    batch_size: int = 1
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION_DEFAULT
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    block_size: int = 16
    weight_dtype: str = "auto"
    kv_cache_memory: int | None = None  # as the engine's flag: the KV budget, given directly

    def __post_init__(self) -> None:
        # CacheConfig owns the rules (and flag-naming messages) for these three.
        CacheConfig(
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise PlanError("--kv-cache-memory must be positive, e.g. 512MiB")
        if self.gpu_memory <= 0:
            raise PlanError(f"--memory must be positive, e.g. 80GiB (got {self.gpu_memory})")
        for flag, value in (
            ("--context", self.context_len),
            ("--batch", self.batch_size),
            ("--tensor-parallel-size", self.tensor_parallel_size),
        ):
            if value is not None and value <= 0:
                raise PlanError(f"{flag} must be a positive integer, got {value}")


def make_plan(shape: ModelShape, inputs: PlanInputs) -> Plan:
    """Compute the plan: weights per GPU, the KV budget, and each KV dtype's capacity."""
    if inputs.weight_dtype in ("float32", "bfloat16", "float16"):
        # As in the engine, --dtype sets the compute dtype, which `--kv-cache-dtype auto` follows.
        shape = dataclasses.replace(shape, torch_dtype=inputs.weight_dtype)
    context_len = inputs.context_len or shape.max_position_embeddings
    if context_len is None:
        raise PlanError(
            f"{shape.name}: the config gives no max_position_embeddings; give --context N"
        )
    tp = inputs.tensor_parallel_size
    total_weights = weight_bytes(shape, inputs.weight_dtype)
    per_gpu = weight_bytes_per_gpu(total_weights, tp)
    usable = math.floor(Fraction(str(inputs.gpu_memory_utilization)) * inputs.gpu_memory)
    budget = usable - per_gpu if inputs.kv_cache_memory is None else inputs.kv_cache_memory
    selected = "fp8_e4m3" if inputs.kv_cache_dtype == "fp8" else inputs.kv_cache_dtype
    compared = KV_DTYPES_COMPARED + (() if selected in KV_DTYPES_COMPARED else (selected,))
    dtypes = tuple(
        _dtype_plan(
            kv_layout(shape, name, inputs.block_size, tp),
            name,
            budget,
            context_len,
            inputs.batch_size,
        )
        for name in compared
    )
    return Plan(
        model_name=shape.name, source=shape.source, architecture=shape.architecture,
        attention=shape.attention_name, num_params=estimate_num_params(shape),
        params_exact=shape.num_params is not None,
        weight_dtype=resolve_weight_dtype(shape, inputs.weight_dtype),
        weight_bytes=total_weights, weight_bytes_per_gpu=per_gpu, gpu_name=inputs.gpu_name,
        gpu_memory=inputs.gpu_memory, gpu_memory_utilization=inputs.gpu_memory_utilization,
        usable_memory=usable, kv_budget=budget, context_len=context_len,
        batch_size=inputs.batch_size, block_size=inputs.block_size, tensor_parallel_size=tp,
        kv_cache_dtype=selected, dtypes=dtypes,
        notes=_notes(shape, context_len, budget),
    )  # fmt: skip


def _dtype_plan(
    layout: KVLayout, name: str, budget: int, context_len: int, batch_size: int
) -> DtypePlan:
    per_seq = layout.bytes_per_sequence(context_len)
    max_seqs = layout.max_num_seqs(budget, context_len)
    capacity = kv_capacity(layout, budget, context_len)
    return DtypePlan(
        kv_cache_dtype=name,
        storage_dtype=layout.dtype,
        bytes_per_token=layout.bytes_per_token,
        bytes_per_block=layout.bytes_per_block,
        bytes_per_sequence=per_seq,
        bytes_for_batch=per_seq * batch_size,
        block_bytes_per_sequence=layout.block_bytes_per_sequence(context_len),
        num_blocks=capacity.num_blocks,
        max_num_seqs=max_seqs,
        max_concurrency=capacity.max_concurrency,
        max_model_len=layout.max_model_len(budget),
        batch_fits=max_seqs >= batch_size,
        formula=layout.formula,
    )


def _notes(shape: ModelShape, context_len: int, budget: int) -> tuple[str, ...]:
    """Caveats the reader of the table must not miss."""
    notes = []
    if budget <= 0:
        notes.append(
            "the weights alone exceed the usable memory: raise "
            "--tensor-parallel-size, pick a larger GPU or a smaller --dtype"
        )
    limit = shape.max_position_embeddings
    if limit is not None and context_len > limit:
        notes.append(
            f"--context {context_len:,} exceeds the model's max_position_embeddings ({limit:,})"
        )
    if shape.num_params is None:
        notes.append(
            "parameters estimated from the config (embeddings, attention, MLP/experts, norms)"
        )
    notes.append(
        "activations are not counted: the engine profiles them at start-up, so its "
        "KV budget is somewhat lower"
    )
    return tuple(notes)
