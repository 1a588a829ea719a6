"""Frozen configuration dataclasses, composed into EngineConfig.

Each user-facing field carries its flag's help text in ``metadata["help"]``, so the CLI builds
its flags from the fields (one field, one flag, one help text).  Validation raises ValueError
naming the flag and the fix.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvserve.errors import ParameterError, UserInputError

GPU_MEMORY_UTILIZATION_DEFAULT = 0.9  # vLLM's; the engine's GPU sizing and the planner
# "bfloat16" as vLLM takes it: a 16-bit cache under a float32 model (CPUs without bf16 math).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "k8v4")
# KV dtypes whose keys and values are stored in two formats: (keys', values').  k8v4: keys
# carry almost all of int4's loss (docs/decisions/kv-int4-rotation.md), so they keep 8 bits.
SPLIT_KV_DTYPES = {"k8v4": ("int8", "int4")}


def key_value_dtypes(kv_dtype: str) -> tuple[str, str]:
    """The storage dtype names of a cache's keys and of its values."""
    return SPLIT_KV_DTYPES.get(kv_dtype, (kv_dtype, kv_dtype))


MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_DTYPES = ("auto", "float", "int8", "int4")
ATTENTION_BACKENDS = ("auto", "torch", "cpu-paged", "flex")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
LAYER_TYPES = ("full_attention", "sliding_attention")
# The MLP gate activations the model runs (Hugging Face's names): SiLU, and Gemma's tanh GELU.
HIDDEN_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
KV_CACHE_DTYPE_CHECKS = ("refuse", "fallback", "off")
KV_OFFLOADING_COMPRESSIONS = ("none", "int8")
KV_OFFLOADING_BACKENDS = ("native",)
PREFIX_CACHE_EVICTIONS = ("arc", "lru")  # kv/eviction.py
# A request's kv_retention_priority (TensorRT-LLM's range and default): 0 is evicted first
DEFAULT_RETENTION_PRIORITY = 35
MAX_RETENTION_PRIORITY = 100
# Lowest top-1 agreement of the quantized KV cache check.  Measured on the embedded model
# (SmolLM2-135M, 267 compared positions): float32 compute int8 99.3%, fp8_e4m3 97.4%, fp8_e5m2
# 93.6%; bfloat16 compute 97.0%, 97.4%, 93.6%.  The 4-bit cache (int4: rotated, key offsets
# subtracted), measured when it came: 91.4% (float32), 91.0% (bfloat16), with int8 at 98.9%
# and 97.8% that day.  0.85 passes all of them, int4 with a margin of 6 points, and refuses a
# dtype that changes one next token in seven (docs/prefix_cache.md).
KV_CACHE_DTYPE_CHECK_MIN_AGREEMENT = 0.85
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")  # vLLM's names, and SGLang's lpm
PREFIX_CACHE_SAVE_INTERVAL_S = 30.0  # --prefix-cache-dir: new blocks are written this often


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(frozen=True)
class TransformerShape:
    """The sizes every decoder-only transformer states, whatever its checkpoint format; the
    engine's ModelConfig and the config.json reader (formats/hf_config.py) both extend it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ModelConfig(TransformerShape):
    """What the engine needs of a model: its shape, RoPE, norms, special tokens."""

    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"  # the checkpoint's dtype
    # Sliding-window attention: the window in tokens (0: none), and which layers use it.
    # `layer_types` holds one of LAYER_TYPES per layer (Hugging Face's names); empty means
    # every layer is "sliding_attention" when sliding_window is set, else "full_attention".
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    # Qwen3 and Gemma 3: an RMSNorm over each query and key head (weights [head_dim]), after
    # the projection and before RoPE.
    qk_norm: bool = False
    # Gemma: every RMSNorm scales by (1 + weight) in float32 (the weights as Hugging Face
    # stores them), and the layers add a norm after attention and one on each side of the MLP.
    gemma_norms: bool = False
    hidden_activation: str = "silu"  # the MLP's gate activation: one of HIDDEN_ACTIVATIONS
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden_size), in the model's dtype
    # The attention scale is query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # The sliding-window layers' RoPE base, with default RoPE (Gemma 3's rope_local_base_freq);
    # None: every layer uses rope_theta and rope_scaling.
    rope_local_base_freq: float | None = None
    # The GGUF type of the checkpoint's projection weights where it stores them quantized
    # (Q4_1, Q8_0, ...), "" where float: --weight-dtype auto quantizes only such a model's.
    stored_weight_type: str = ""

    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window in tokens, 0 for full attention."""
        if not self.sliding_window:
            return (0,) * self.num_layers
        types = self.layer_types or ("sliding_attention",) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in types)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UserInputError(
                f"the model's num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise UserInputError(
                f"the model's layer_types lists {len(self.layer_types)} layers; it has "
                f"{self.num_layers}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise UserInputError(
                f"unsupported layer type(s) {', '.join(map(repr, unknown))}; supported: "
                f"{', '.join(LAYER_TYPES)}"
            )
        if self.hidden_activation not in HIDDEN_ACTIVATIONS:
            raise UserInputError(
                f"unsupported hidden activation {self.hidden_activation!r}; supported: "
                f"{', '.join(HIDDEN_ACTIVATIONS)}"
            )
        if self.sliding_window < 0:
            raise UserInputError(f"sliding_window must be >= 0, got {self.sliding_window}")


@dataclass(frozen=True)
class CacheConfig:
    """How the KV cache is laid out and how much memory it gets."""

    block_size: int = field(default=16, metadata=_help("Tokens per KV cache block."))
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_help(
            "KV cache storage dtype: auto (the model dtype), bfloat16, fp8 (= fp8_e4m3), "
            "fp8_e5m2, int8, int4 (4-bit codes of rotated rows, one scale per token and head), "
            "k8v4 (int8 keys, int4 values).",
            choices=KV_CACHE_DTYPES,
        ),
    )
    kv_cache_memory: int | None = field(
        default=None,
        metadata=_help(
            "Bytes given to the KV cache, e.g. 512MiB or 2GiB. Overrides "
            "--gpu-memory-utilization. On a CPU, refused when it would leave less than "
            "max(1 GiB, a tenth of RAM) of host memory available.",
            parse="size",
        ),
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata=_help(
            "Fraction of device memory for weights + activations + KV cache (default 0.9 on "
            "a GPU). On a CPU, only when given: the fraction of the host memory available at "
            "start-up for weights + KV cache, refused when it would leave less than "
            "max(1 GiB, a tenth of RAM) available."
        ),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_help("Reuse the KV of cached prompt prefixes.")
    )
    kv_offloading_size: float | None = field(
        default=None,
        metadata=_help(
            "GiB of host memory for a second tier of the prefix cache (vLLM's flag): cached "
            "blocks evicted from the KV cache, a preempted request's included, are copied "
            "there (pinned memory on CUDA) and copied back on a hit instead of being "
            "recomputed. Needs prefix caching.",
            metavar="GIB",
        ),
    )
    kv_offloading_backend: str = field(
        default="native",
        metadata=_help(
            "vLLM's flag: what moves blocks to the tiers. kvserve has its own (native) only; "
            "vLLM's lmcache is not served.",
            choices=KV_OFFLOADING_BACKENDS,
        ),
    )
    kv_offloading_compression: str | None = field(
        default=None,
        metadata=_help(
            "How the host tier stores a block: int8 (8-bit codes and a float32 scale per "
            "token and head, kvserve's int8 KV format: ~3.6x the blocks of a float32 cache "
            "in the same GiB, ~1.9x of a bfloat16 one; a hit is dequantized into the cache "
            "block) or none (the cache's own bytes). Default: int8 on a CPU, where the tier "
            "shares RAM with the KV cache and holds more only when compressed; none on a GPU. "
            "A cache already quantized (--kv-cache-dtype) is stored as it is.",
            choices=KV_OFFLOADING_COMPRESSIONS,
        ),
    )
    kv_offloading_dir: str | None = field(
        default=None,
        metadata=_help(
            "A disk tier below the host tier (needs --kv-offloading-size): blocks the host "
            "tier drops are written to files in DIR/<fingerprint> by a thread, in the host "
            "tier's format, and read back into it on a hit instead of being recomputed; a "
            "restarted server (or another one of the same model, dtypes and block size) finds "
            "them. See docs/prefix_cache.md.",
            metavar="DIR",
        ),
    )
    kv_offloading_dir_size: int = field(
        default=16 * 2**30,
        metadata=_help(
            "Size budget of --kv-offloading-dir, e.g. 16GiB: whole blocks, the least "
            "recently used files go first.",
            parse="size",
        ),
    )
    kv_offloading_store_threshold: int = field(
        default=2,
        metadata=_help(
            "Admission to the tiers below the KV cache (vLLM's store_threshold): an evicted "
            "block takes the place of another in a full host tier (a host drop, in a full "
            "disk tier) only once requests have computed or hit it N times; free room takes "
            "every block. 2 keeps a shared system prompt through bursts of one-off prompts "
            "and measured no worse on multi-turn chat; 1 stores every block "
            "(docs/prefix_cache.md).",
            metavar="N",
        ),
    )
    public_prefixes: str | None = field(
        default=None,
        metadata=_help(
            "File of public prompt prefixes (one text per line, or a JSON list of texts and "
            "chat messages): blocks lying entirely inside one are shared across cache_salt "
            "values. See docs/prefix_cache.md.",
            metavar="FILE",
        ),
    )
    enable_cross_salt_miss_reason: bool = field(
        default=False,
        metadata=_help(
            "Count a miss of prompt tokens cached under another cache_salt as `isolated` in "
            "kvserve:prefix_cache_miss_tokens_total (default: `never_seen`, so that no client "
            "reading /metrics learns whether another tenant sent a prompt). For one-tenant "
            "deployments diagnosing their salts."
        ),
    )
    kv_events_config: str | None = field(
        default=None,
        metadata=_help(
            "KV cache events as vLLM publishes them, as JSON, e.g. "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"}\' '
            "(bound to tcp://127.0.0.1:5557 unless endpoint says otherwise; "
            '"tcp://*:5557" exposes them on every interface). Blocks under a cache_salt are '
            "announced without their token ids unless publish_salted_token_ids is true. "
            "See docs/prefix_cache.md.",
            metavar="JSON",
        ),
    )
    prefix_cache_dir: str | None = field(
        default=None,
        metadata=_help(
            "Keep the prefix cache on disk in DIR: full cached blocks are written every "
            f"{PREFIX_CACHE_SAVE_INTERVAL_S:.0f} s while serving and at a clean shutdown, and "
            "loaded back at start-up when the model, dtypes, block size and tokenizer match.",
            metavar="DIR",
        ),
    )
    prefix_cache_dir_max_size: int = field(
        default=4 * 2**30,
        metadata=_help(
            "Size budget of --prefix-cache-dir, e.g. 4GiB; the oldest block groups go first.",
            parse="size",
        ),
    )
    prefix_cache_eviction: str = field(
        default="arc",
        metadata=_help(
            "Which cached blocks the KV cache and the host tier evict first: arc (Adaptive "
            "Replacement Cache: blocks reused since they were cached outlive one-off ones, so "
            "a burst of long one-off prompts cannot flush a shared system prompt) or lru. "
            "Within either, a request's kv_retention_priority orders eviction (lowest first).",
            choices=PREFIX_CACHE_EVICTIONS,
        ),
    )
    max_pinned_prefix_fraction: float = field(
        default=0.25,
        metadata=_help(
            "Largest fraction (0-1) of the KV cache's blocks that pinned prefixes "
            "(POST /v1/prefix_cache/pin) may hold together; past it a pin gets HTTP 400. "
            "0 turns pinning off."
        ),
    )
    kv_cache_dtype_check: str = field(
        default="refuse",
        metadata=_help(
            "With a quantized --kv-cache-dtype (8- or 4-bit), compare a canary text's logits "
            "through the quantized and the full-precision cache at start-up: refuse (exit when "
            "the top-1 agreement is below --kv-cache-dtype-check-min-agreement, naming a dtype "
            "that passes), "
            "fallback (log and use that dtype instead), off.",
            choices=KV_CACHE_DTYPE_CHECKS,
        ),
    )
    kv_cache_dtype_check_min_agreement: float = field(
        default=KV_CACHE_DTYPE_CHECK_MIN_AGREEMENT,
        metadata=_help(
            "Lowest top-1 agreement (0-1) of the quantized KV cache check "
            f"(default {KV_CACHE_DTYPE_CHECK_MIN_AGREEMENT}: measured on the embedded model, "
            "see docs/prefix_cache.md)."
        ),
    )

    def __post_init__(self) -> None:
        self._validate_store()
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ParameterError(
                "--block-size", f"must be a positive power of two, got {self.block_size}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ParameterError(
                "--kv-cache-dtype",
                f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ParameterError("--kv-cache-memory", "must be positive, e.g. 512MiB")
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise ParameterError("--gpu-memory-utilization", f"must be in (0, 1], got {util}")
        self._validate_offloading()

    def _validate_offloading(self) -> None:
        size = self.kv_offloading_size
        if size is None:
            if self.kv_offloading_dir is not None:
                raise ParameterError(
                    "--kv-offloading-dir",
                    "is the tier below the host tier: add --kv-offloading-size GIB",
                )
            return
        if not size > 0:  # also refuses NaN
            raise ParameterError("--kv-offloading-size", f"must be positive GiB, got {size}")
        if self.kv_offloading_dir_size <= 0:
            raise ParameterError("--kv-offloading-dir-size", "must be positive, e.g. 16GiB")
        if self.kv_offloading_store_threshold < 1:
            raise ParameterError(
                "--kv-offloading-store-threshold",
                f"must be >= 1 (1: store every evicted block), got "
                f"{self.kv_offloading_store_threshold}",
            )
        if self.kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
            raise ParameterError(
                "--kv-offloading-backend",
                f"must be native (kvserve's own tiers), got {self.kv_offloading_backend!r}",
            )
        compression = self.kv_offloading_compression
        if compression is not None and compression not in KV_OFFLOADING_COMPRESSIONS:
            raise ParameterError(
                "--kv-offloading-compression",
                f"must be one of {', '.join(KV_OFFLOADING_COMPRESSIONS)}, got {compression!r}",
            )
        if not self.enable_prefix_caching:
            raise ParameterError(
                "--kv-offloading-size",
                "keeps prefix-cache blocks in host memory: it needs prefix caching on "
                "(drop --no-enable-prefix-caching)",
            )

    def _validate_store(self) -> None:
        if self.prefix_cache_dir_max_size <= 0:
            raise ParameterError("--prefix-cache-dir-max-size", "must be positive, e.g. 4GiB")
        if self.kv_cache_dtype_check not in KV_CACHE_DTYPE_CHECKS:
            raise ParameterError(
                "--kv-cache-dtype-check", f"must be one of {', '.join(KV_CACHE_DTYPE_CHECKS)}"
            )
        if not 0.0 <= self.kv_cache_dtype_check_min_agreement <= 1.0:
            raise ParameterError("--kv-cache-dtype-check-min-agreement", "must be in [0, 1]")
        if self.prefix_cache_eviction not in PREFIX_CACHE_EVICTIONS:
            raise ParameterError(
                "--prefix-cache-eviction", f"must be one of {', '.join(PREFIX_CACHE_EVICTIONS)}"
            )
        if not 0.0 <= self.max_pinned_prefix_fraction <= 1.0:
            raise ParameterError(
                "--max-pinned-prefix-fraction",
                f"must be in [0, 1], got {self.max_pinned_prefix_fraction}",
            )
        self.kv_events  # noqa: B018 - parses the JSON: a bad value fails at start-up

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """The parsed --kv-events-config; None when events are off."""
        return parse_kv_events_config(self.kv_events_config)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (the JSON of --kv-events-config), the fields kvserve uses, then
    kvserve's own: the replay bounds and the tenants' token ids (docs/prefix_cache.md)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" publishes; "null" drops the events
    # Bound when wildcard (*, ::), loopback, ipc:// or inproc://, else connected to; the
    # default is this host only: "tcp://*:5557" exposes the events on every interface.
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None  # a ROUTER socket that resends buffered batches
    buffer_steps: int = 10_000  # batches kept for replay, at most
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    buffer_max_bytes: int = 64 * 2**20  # encoded batches kept for replay, at most
    replay_max_batches: int = 1_000  # batches sent back to one replay request, at most
    publish_salted_token_ids: bool = False  # token ids of blocks under a cache_salt


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """--kv-events-config's JSON -> KVEventsConfig, None when events are off; ParameterError
    names the flag and the field."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ParameterError("--kv-events-config", f"is not valid JSON ({exc})") from None
    known = {f.name for f in fields(KVEventsConfig)}
    if not isinstance(raw, dict) or set(raw) - known:
        unknown = sorted(set(raw) - known) if isinstance(raw, dict) else raw
        raise ParameterError(
            "--kv-events-config", f"must be a JSON object of {sorted(known)}, got {unknown}"
        )
    config = KVEventsConfig(**raw)
    if config.publisher not in ("null", "zmq"):
        raise ParameterError(
            "--kv-events-config", f'publisher must be "zmq" or "null", got {config.publisher!r}'
        )
    _check_kv_events_types(config)
    return config if config.enable_kv_cache_events and config.publisher == "zmq" else None


def _check_kv_events_types(config: KVEventsConfig) -> None:
    """ParameterError naming the field whose JSON value has the wrong type or is not positive
    (the publisher's bounds are never 0: a 0-sized queue or buffer would be unbounded)."""
    for f in fields(KVEventsConfig):
        value, default = getattr(config, f.name), f.default
        if isinstance(default, bool):
            ok, want = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            want = "a positive integer"
        else:
            ok = isinstance(value, str) or (value is None and default is None)
            want = "a string or null" if default is None else "a string"
        if not ok:
            raise ParameterError("--kv-events-config", f"{f.name} must be {want}, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets of one engine step; pure numbers so the scheduler can be tested alone."""

    max_num_seqs: int = field(
        default=256, metadata=_help("Maximum number of sequences in one step.")
    )
    max_num_batched_tokens: int = field(
        default=2048, metadata=_help("Maximum number of tokens computed in one step.")
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_help("Maximum tokens (prompt + output) per sequence; default: the model's."),
    )
    allow_long_max_model_len: bool = field(
        default=False,
        metadata=_help(
            "Accept a --max-model-len beyond the model's trained context "
            "(max_position_embeddings), where outputs degrade; also "
            "KVSERVE_ALLOW_LONG_MAX_MODEL_LEN=1."
        ),
    )

    scheduling_policy: str = field(
        default="fcfs",
        metadata=_help(
            "Order in which waiting requests are admitted: fcfs (arrival order), priority "
            "(the request field `priority`, lower first, ties by arrival; vLLM's), lpm "
            "(longest cached prefix first, device and host tier counted, so requests that "
            "share a cached prefix run while it is cached; see --scheduling-max-wait-s).",
            choices=SCHEDULING_POLICIES,
        ),
    )
    scheduling_max_wait_s: float = field(
        default=10.0,
        metadata=_help(
            "With --scheduling-policy lpm: a request that has waited this many seconds is "
            "admitted before any that has not, whatever its cached prefix (no starvation)."
        ),
    )

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ParameterError(
                "--scheduling-policy",
                f"must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}",
            )
        if self.scheduling_max_wait_s <= 0:
            raise ParameterError("--scheduling-max-wait-s", "must be positive (seconds)")
        if self.max_num_seqs <= 0:
            raise ParameterError("--max-num-seqs", "must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ParameterError("--max-num-batched-tokens", "must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ParameterError("--max-model-len", "must be positive")


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ParameterError(
                "--cpu-threads-bind", f"expected auto, all or a CPU list like 0-3,8; got {text!r}"
            )
        cpus.extend(range(int(first), int(last or first) + 1))
    return sorted(set(cpus))


@dataclass(frozen=True)
class LoadConfig:
    """Which checkpoint to load, and how."""

    model: str | None = field(
        default=None,
        metadata=_help("GGUF file or Hugging Face directory; default: embedded SmolLM2-135M."),
    )
    dtype: str = field(
        default="auto",
        metadata=_help(
            "Weights/activations dtype: auto (bfloat16 on a CPU with native bf16, else "
            "float32; the checkpoint's dtype on CUDA), float32, bfloat16, float16.",
            choices=MODEL_DTYPES,
        ),
    )
    weight_dtype: str = field(
        default_factory=lambda: os.environ.get("KVSERVE_WEIGHT_DTYPE", "auto"),
        metadata=_help(
            "How the projections and the LM head hold their weights: float (the checkpoint's "
            "values in --dtype), int8 (8-bit codes with a float32 scale per 32 inputs, 3.6x "
            "fewer bytes than float32, at an 8-bit rounding of each weight: a CPU kernel "
            "dequantizes them in registers for steps of up to 8 rows, where reading the "
            "weights bounds a step, and larger steps multiply them dequantized), int4 (the "
            "projections as GGUF Q4_1-style blocks, 0.625 bytes a weight, a Q4_1 GGUF's own "
            "codes, multiplied with activations rounded to 8-bit blocks as llama.cpp does; the "
            "LM head int8), or auto "
            "(int8 copies for steps of up to 8 rows, the float weights kept for larger ones, "
            "where the checkpoint stores its weights quantized, a GGUF's Q4_1 or Q8_0, and a "
            "CPU computes in float32; float elsewhere). CPU only; not with "
            "--tensor-parallel-size > 1. Default: auto, or KVSERVE_WEIGHT_DTYPE when set.",
            choices=WEIGHT_DTYPES,
        ),
    )
    device: str = field(default="auto", metadata=_help("cpu, cuda, cuda:N or auto."))
    seed: int = field(default=0, metadata=_help("Seed for requests that give none."))
    tensor_parallel_size: int = field(
        default=1,
        metadata=_help(
            "Tensor-parallel ranks: the model's heads, MLP and vocabulary split over N "
            "processes joined by torch.distributed (gloo on a CPU, NCCL on CUDA)."
        ),
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata=_help(
            "Where ranks 1..N-1 of --tensor-parallel-size run: mp (local processes) or ray "
            "(Ray actors on the cluster of RAY_ADDRESS or `ray start`, else a local one; "
            "pip install 'kvserve[ray]').",
            choices=DISTRIBUTED_EXECUTOR_BACKENDS,
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=_help(
            "Attention implementation: auto (cpu-paged on a CPU when its C kernel builds, else "
            "torch; flex on CUDA), torch (the PyTorch reference), cpu-paged (C kernel reading "
            "KV blocks in place; CPU only), flex (PyTorch FlexAttention over the block tables: "
            "compiled on CUDA, eager and slow on a CPU).",
            choices=ATTENTION_BACKENDS,
        ),
    )

    enforce_eager: bool = field(
        default_factory=lambda: os.environ.get("KVSERVE_ENFORCE_EAGER") == "1",
        metadata=_help(
            "Run the layers eagerly, without torch.compile (which fuses their element-wise "
            "work; it compiles at start-up, once per machine thanks to its disk cache) and, on "
            "CUDA, without CUDA graphs of the decode steps. "
            "Default: off, or on when KVSERVE_ENFORCE_EAGER=1."
        ),
    )
    cpu_threads_bind: str = field(
        default="auto",
        metadata=_help(
            "CPU compute threads (vLLM's VLLM_CPU_OMP_THREADS_BIND): auto (every CPU on up to "
            "2 physical cores; beyond, one pinned thread per physical core, the first core "
            "left to HTTP and tokenization), all (every CPU, unpinned), or a CPU list such as "
            "0-7,16 (one pinned thread per CPU, the rest left to the server)."
        ),
    )

    def __post_init__(self) -> None:
        if self.cpu_threads_bind not in ("auto", "all"):
            parse_cpu_list(self.cpu_threads_bind)  # ParameterError naming the flag
        if self.dtype not in MODEL_DTYPES:
            raise ParameterError("--dtype", f"must be one of {', '.join(MODEL_DTYPES)}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ParameterError(
                "--weight-dtype",
                f"must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}",
            )
        if self.weight_dtype in ("int8", "int4") and self.tensor_parallel_size > 1:
            raise ParameterError(
                "--weight-dtype",
                f"{self.weight_dtype} weights are not sharded over tensor-parallel ranks; use "
                "--weight-dtype float (or auto) with --tensor-parallel-size > 1",
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ParameterError(
                "--attention-backend",
                f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}",
            )
        if self.tensor_parallel_size < 1:
            raise ParameterError(
                "--tensor-parallel-size", f"must be positive, got {self.tensor_parallel_size}"
            )
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ParameterError(
                "--distributed-executor-backend",
                f"must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}",
            )


@dataclass(frozen=True)
class RequestLimits:
    """Caps on what one request may ask for, so that no single request (or flood of them) can
    take the engine's memory or its thread: each is checked before the engine sees the
    request, and each error names the flag that raises the cap."""

    max_prompts_per_request: int = field(
        default=256, metadata=_help("Most prompts in one /v1/completions request.")
    )
    max_sequences_per_request: int = field(
        default=256,
        metadata=_help("Most sequences one request may start: prompts x n."),
    )
    max_stop_strings: int = field(default=16, metadata=_help("Most stop strings per request."))
    max_stop_string_length: int = field(
        default=256, metadata=_help("Longest stop string, in characters.")
    )
    max_stop_token_ids: int = field(
        default=1024, metadata=_help("Most stop_token_ids per request.")
    )
    max_cache_salt_length: int = field(
        default=1024, metadata=_help("Longest cache_salt, in characters.")
    )
    max_prompt_chars: int = field(
        default=2**20,
        metadata=_help(
            "Longest text prompt (completions, /tokenize) or chat conversation (all message "
            "contents together), in characters; tokenizing it must not hold a tokenizer "
            "thread for long."
        ),
    )
    max_logprobs: int = field(
        default=20, metadata=_help("Most top logprobs per token a request may ask for.")
    )
    max_waiting_requests: int = field(
        default=4096,
        metadata=_help(
            "Most sequences waiting to run; beyond it requests get HTTP 429 with Retry-After."
        ),
    )

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0 or (value == 0 and name != "max_logprobs"):
                raise ParameterError(
                    f"--{name.replace('_', '-')}", f"must be positive, got {value}"
                )

    def check_fanout(self, num_prompts: int, n: int) -> None:
        """ParameterError when a request carries too many prompts or sequences."""
        if num_prompts > self.max_prompts_per_request:
            raise ParameterError(
                "prompt",
                f"holds {num_prompts} prompts; the limit is {self.max_prompts_per_request} "
                "(--max-prompts-per-request): split the request",
            )
        if num_prompts * n > self.max_sequences_per_request:
            raise ParameterError(
                "n",
                f"is too large: {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; "
                f"the limit is {self.max_sequences_per_request} (--max-sequences-per-request)",
            )

    def check_stop_token_ids(self, num_ids: int) -> None:
        if num_ids > self.max_stop_token_ids:
            raise ParameterError(
                "stop_token_ids",
                f"holds {num_ids} ids; the limit is {self.max_stop_token_ids} "
                "(--max-stop-token-ids)",
            )

    def check_cache_salt(self, cache_salt: str) -> None:
        if len(cache_salt) > self.max_cache_salt_length:
            raise ParameterError(
                "cache_salt",
                f"has {len(cache_salt)} characters; the limit is {self.max_cache_salt_length} "
                "(--max-cache-salt-length)",
            )

    def check_prompt_chars(self, num_chars: int, name: str) -> None:
        """ParameterError naming `name` when a text to tokenize is too long."""
        if num_chars > self.max_prompt_chars:
            raise ParameterError(
                name,
                f"has {num_chars} characters; the limit is {self.max_prompt_chars} "
                "(--max-prompt-chars)",
            )

    def check_stop(self, stop: tuple[str, ...] | list[str]) -> None:
        if len(stop) > self.max_stop_strings:
            raise ParameterError(
                "stop",
                f"holds {len(stop)} strings; the limit is {self.max_stop_strings} "
                "(--max-stop-strings)",
            )
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_string_length:
            raise ParameterError(
                "stop",
                f"holds a string of {longest} characters; the limit is "
                f"{self.max_stop_string_length} (--max-stop-string-length)",
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, composed of the parts above."""

    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)


# EngineConfig's parts, in flag-group order: the CLI and LLM(**kwargs) both read this.
ENGINE_PARTS: tuple[tuple[str, type], ...] = (
    ("load", LoadConfig),
    ("cache", CacheConfig),
    ("scheduler", SchedulerConfig),
    ("limits", RequestLimits),
)


def cache_dir(kind: str) -> Path:
    """Where kvserve keeps what it builds once per machine (converted tokenizers, compiled
    kernels): $KVSERVE_CACHE_DIR/<kind>, default ~/.cache/kvserve/<kind>."""
    root = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    return Path(root) / kind


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip


def parse_size(text: str | int) -> int:
    """Parse '512MiB', '2GiB', '1.5GB' or a plain byte count into bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    unit = (match.group(2) or "").lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 512MiB, 2GiB or 1073741824)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: 1.9 GiB."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
