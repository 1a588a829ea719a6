"""The Llama family (Llama 1-3, Mistral, Qwen2, Qwen3, Gemma 3 text) in one file.

GQA, RoPE (default / linear / llama3 scaling), optional QKV bias, tied or untied embeddings;
sliding-window layers (each layer's window from ModelConfig.layer_windows(), passed to the
backend in its metadata), Qwen3's and Gemma 3's per-head q/k RMSNorm, and Gemma's extras
(norms as (1 + weight) in float32, a norm after attention and on each side of the MLP, tanh
GELU, scaled embeddings, query_pre_attn_scalar, a RoPE base of its own for the local layers).
The model owns weights only: the KV cache tensors, the attention metadata and the backend are
passed into ``forward`` explicitly each step, and so is a decode step's DecodeStepPlan where the
runner asked the backend for one (the model runs its layers in one native call with it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from kvserve.attention import rotation
from kvserve.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    DecodeStepPlan,
    with_window,
)
from kvserve.attention.kv_cache import LayerKVCache
from kvserve.config import ModelConfig
from kvserve.errors import UserInputError
from kvserve.models.fused_mlp import (
    fused_silu_available,
    fused_silu_mul,
    packed_silu_gate_up,
    silu_and_mul,
)
from kvserve.models.native_layers import NativeLayers
from kvserve.models.packed_linear import (
    PackedLinear,
    can_pack,
    logits_kernel_max_rows,
    pack_linear_layers,
    padded_rows,
)
from kvserve.models.q8_decode_step import Q8DecodeStep
from kvserve.models.quantized_linear import Q8Linear, Q8Plan, quantize_linear_layers


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for the model's RoPE variant (float32); `local`:
    the sliding-window layers' where the model gives them a base of their own (Gemma 3:
    rope_local_base_freq, default RoPE)."""
    if local and config.rope_local_base_freq is not None:
        config = replace(config, rope_theta=config.rope_local_base_freq, rope_scaling=None)
    dim = config.head_dim
    # On the CPU whatever the ambient device: arange on the meta device (LlamaForCausalLM's
    # construction) imports torch._dynamo, ~2.5 s of a server's start.
    positions = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu")
    inv_freq = 1.0 / (config.rope_theta ** (positions / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise UserInputError(
        f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(is_medium, smoothed, scaled)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE by halves: x [T, heads, dim], cos/sin [T, 1, dim / 2] (both halves of the
    usual [T, 1, dim] tables are the same).  The same products and sums, in the same order, as
    x * cos + cat(-x2, x1) * sin, so bit for bit the same values; but inductor fuses it into
    one pass over x, where the concatenated rotation was materialized first (0.64 -> 0.35 ms
    for q and k of 2,048 tokens of the embedded model)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight (as Hugging Face stores it, zero-centred) scales by
    (1 + weight), all in float32, cast back at the end (transformers' Gemma3RMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def pre_attention(
    layer: DecoderLayer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm, QKV projection, the per-head q/k norms where the model has them, and RoPE:
    hidden [T, hidden] -> q [T, H, D], k/v [T, Hkv, D]."""
    num_tokens = hidden.shape[0]
    q, k, v = layer.qkv_proj(layer.input_layernorm(hidden)).split(layer.split_sizes, dim=-1)
    q = q.view(num_tokens, layer.num_heads, layer.head_dim)
    k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
    if layer.q_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    return q, k, v.view(num_tokens, layer.num_kv_heads, layer.head_dim)


def post_attention(layer: DecoderLayer, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Output projection, residual, RMSNorm, SiLU-gated MLP, residual: the new hidden state.
    `attn` may have fewer rows than `hidden` (the step's tokens, without the padding rows that
    LlamaForCausalLM.forward adds): zero rows fill it up, inside the compiled kernel."""
    attn = attn.reshape(attn.shape[0], -1)
    if attn.shape[0] != hidden.shape[0]:
        attn = F.pad(attn, (0, 0, 0, hidden.shape[0] - attn.shape[0]))
    if layer.gemma_norms:
        return _gemma_post_attention(layer, hidden, attn)
    hidden = hidden + layer.o_proj(attn)
    normed = layer.post_attention_layernorm(hidden)
    projection = layer.gate_up_proj
    if layer.fused_silu and isinstance(projection, PackedLinear) and projection.bias is None:
        activated = packed_silu_gate_up(
            normed, projection.packed_weight, projection.out_features // 2, projection.kernel_rows
        )
    else:
        gate_up = projection(normed)
        activated = fused_silu_mul(gate_up) if layer.fused_silu else silu_and_mul(gate_up)
    return hidden + layer.down_proj(activated)


def _gemma_post_attention(
    layer: DecoderLayer, hidden: torch.Tensor, attn: torch.Tensor
) -> torch.Tensor:
    """Gemma's order: output projection, its norm, residual; pre-MLP norm, tanh-GELU-gated
    MLP, post-MLP norm, residual (transformers' Gemma3DecoderLayer)."""
    hidden = hidden + layer.post_attention_layernorm(layer.o_proj(attn))
    gate, up = layer.gate_up_proj(layer.pre_feedforward_layernorm(hidden)).chunk(2, dim=-1)
    activated = F.gelu(gate, approximate="tanh") * up
    return hidden + layer.post_feedforward_layernorm(layer.down_proj(activated))


def between_attentions(
    layer: DecoderLayer,
    next_layer: DecoderLayer,
    hidden: torch.Tensor,
    attn: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's post_attention and the next one's pre_attention: the new hidden state and
    the next layer's q, k, v."""
    hidden = post_attention(layer, hidden, attn)
    return (hidden, *pre_attention(next_layer, hidden, cos, sin))


@dataclass(frozen=True)
class LayerKernels:
    """The work between attentions: eager, or compiled by torch.compile (inductor fuses the
    element-wise work: RMSNorm, RoPE, SiLU x gate and the residual adds, which eager PyTorch
    runs as ~20 separate passes over memory).  A step calls `pre_attention` once, then
    `between_attentions` for each pair of neighbouring layers, then `post_attention` once:
    one compiled call per layer instead of two (each costs ~60-100 us of guards and wrappers,
    measured per 32-row decode step)."""

    pre_attention: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    between_attentions: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    post_attention: Callable[..., torch.Tensor]


EAGER = LayerKernels(pre_attention, between_attentions, post_attention)


def compiled_kernels() -> LayerKernels:
    """Each through torch.compile with dynamic token counts (one graph for every layer and
    every batch size, reused across processes by inductor's on-disk cache)."""
    return LayerKernels(
        *(torch.compile(fn, dynamic=True)
          for fn in (pre_attention, between_attentions, post_attention))
    )  # fmt: skip


class DecoderLayer(nn.Module):
    """One layer's weights and shape; LlamaForCausalLM.forward runs the layers through its
    LayerKernels, with attention between."""

    def __init__(self, config: ModelConfig, sliding_window: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        scalar = config.query_pre_attn_scalar
        self.scale = (config.head_dim if scalar is None else scalar) ** -0.5
        # The window this layer attends over (0: full attention); which RoPE table it takes.
        self.sliding_window = sliding_window
        # [kv_heads, head_dim] each, for a rotated (4-bit) cache (runner/key_offsets.py): keys
        # divided and queries multiplied by the channel scales, the rotated offset subtracted
        # from the rotated keys; None until calibrated
        self.key_offset: torch.Tensor | None = None
        self.key_channel_scale: torch.Tensor | None = None
        self.key_sink: torch.Tensor | None = None  # float32, as an int4 cache stores it
        self.local_rope = bool(sliding_window) and config.rope_local_base_freq is not None
        norm = GemmaRMSNorm if config.gemma_norms else RMSNorm
        self.gemma_norms = config.gemma_norms
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        # Llama: the MLP's input norm; Gemma: the attention output's (pre_feedforward_layernorm
        # is then the MLP's input norm).
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if config.qk_norm:
            self.q_norm = norm(config.head_dim, config.rms_norm_eps)
            self.k_norm = norm(config.head_dim, config.rms_norm_eps)
        if config.gemma_norms:
            self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        # SiLU x up through the C kernel (fused_mlp.py): set for bfloat16 on a CPU that has it.
        self.fused_silu = False

    @property
    def is_plain(self) -> bool:
        """A Llama layer: no q/k norms, no Gemma norms, SiLU (what the native layers and the
        fused SiLU kernel take)."""
        return self.q_norm is None and not self.gemma_norms


@functools.cache
def _multiplier_in(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype`, as transformers multiplies Gemma's embeddings: by a float32
    scalar tensor cast to the weights' dtype (a Python number, so that no tensor is made on
    the device each step: CUDA graphs capture the step)."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # An uninitialised weight (a checkpoint's replaces it): random init on the meta device
        # imports torch._dynamo (see rope_inv_freq).
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(
            DecoderLayer(config, window) for window in config.layer_windows()
        )
        self.norm = (GemmaRMSNorm if config.gemma_norms else RMSNorm)(
            config.hidden_size, config.rms_norm_eps
        )
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        # The local layers' RoPE where it differs (Gemma 3), else None.
        local = rope_inv_freq(config, True) if any(x.local_rope for x in self.layers) else None
        self.register_buffer("inv_freq_local", local, persistent=False)
        self.kernels = EAGER
        # The same work in C for every step (native_layers.py); None: not for this model.
        self.native_layers: NativeLayers | None = None
        # A float32 model's decode steps over 8-bit weights in C (q8_decode_step.py), or None.
        self.q8_step: Q8DecodeStep | None = None
        # The LM head's own weights where they differ from the embedding's table or the
        # lm_head Linear: oneDNN-packed (pack_weights) or 8-bit (quantize_weights).
        self.logits_head: PackedLinear | Q8Linear | None = None
        # Run every layer on the row count the packed projections are asked for (see forward).
        self.pads_rows = False

    def compile(self) -> None:  # type: ignore[override]
        """Run the layers' element-wise work through torch.compile from now on."""
        self.kernels = compiled_kernels()

    def use_native_layers(self) -> bool:
        """Run every step's layers through native/csrc/layer/decode_layer.c from now on (the
        compiled layers' values, without their per-layer overhead); False where it cannot
        serve them."""
        if not all(layer.is_plain for layer in self.layers):
            return False  # q/k norms, Gemma's norms and GELU: the C code has none of them
        self.native_layers = NativeLayers.build(self.layers)
        return self.native_layers is not None

    def use_q8_decode_step(self) -> bool:
        """Run decode-only steps of a few rows through native/csrc/layer/decode_step_q8.c from
        now on (float32 layers over 8-bit weights); False where it cannot serve them."""
        self.q8_step = Q8DecodeStep.build(self.layers)
        return self.q8_step is not None

    def set_rope(self, device: torch.device) -> None:
        """The RoPE tables on `device` (after a build on the meta device)."""
        self.inv_freq = rope_inv_freq(self.config).to(device)
        if self.inv_freq_local is not None:
            self.inv_freq_local = rope_inv_freq(self.config, True).to(device)

    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        q8: Q8Plan | None = None,
    ) -> LlamaForCausalLM:
        """Build on the meta device (no random init), then take the given weights; with `q8`,
        the projections and the LM head as 8-bit blocks (quantized_linear.py)."""
        with torch.device("meta"):
            model = cls(config)
        state = {name: tensor.to(device=device, dtype=dtype) for name, tensor in weights.items()}
        model.load_state_dict(state, strict=True, assign=True)
        model.set_rope(device)
        model.eval()
        if q8 is not None:
            model.quantize_weights(q8)
        if can_pack(device, dtype):
            model.pack_weights()
        model.use_fused_silu(device, dtype)
        return model

    def use_fused_silu(self, device: torch.device, dtype: torch.dtype) -> None:
        """SiLU x up through the C kernel from now on where it serves this device and dtype
        (fused_mlp.py); elsewhere torch's expression stays."""
        enabled = fused_silu_available(device, dtype)
        for layer in self.layers:
            layer.fused_silu = enabled and layer.is_plain

    def quantize_weights(self, plan: Q8Plan) -> None:
        """Every projection, and the LM head, as 8-bit blocks (quantized_linear.py); the tied
        embedding keeps its float table for the lookups."""
        head = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        self.logits_head = Q8Linear(head, None, plan.kernel_rows, plan.keep_float)
        if not self.config.tie_word_embeddings:
            del self.lm_head
        quantize_linear_layers(self.layers, plan.kernel_rows, plan.keep_float, plan.bits)

    def pack_weights(self) -> None:
        """Every projection, and the LM head, through oneDNN-prepacked weights (see
        packed_linear.py); the tied embedding keeps its plain table for the lookups.  Weights
        already quantized (quantize_weights) stay so."""
        if self.logits_head is None:
            head = (
                self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
            )
            self.logits_head = PackedLinear(head, None, logits_kernel_max_rows())
            if not self.config.tie_word_embeddings:
                del self.lm_head
        pack_linear_layers(self.layers)
        self.pads_rows = True

    def set_key_offsets(
        self,
        offsets: Sequence[torch.Tensor],
        channel_scales: Sequence[torch.Tensor],
        sinks: Sequence[torch.Tensor],
    ) -> None:
        """Each layer's key offset and channel scales (runner/key_offsets.py), in the
        activations' dtype, and its key sink in float32 (what the cache's kernels read)."""
        if not len(offsets) == len(channel_scales) == len(sinks) == len(self.layers):
            raise ValueError(f"{len(offsets)} key offsets, {len(channel_scales)} channel "
                             f"scales, {len(sinks)} key sinks for {len(self.layers)} "
                             "layers")  # fmt: skip
        for layer, offset, scale, sink in zip(
            self.layers, offsets, channel_scales, sinks, strict=True
        ):
            layer.key_offset = offset.to(self.dtype)
            layer.key_channel_scale = scale.to(self.dtype)
            layer.key_sink = sink.to(torch.float32).contiguous()

    @property
    def dtype(self) -> torch.dtype:
        """The weights' and activations' dtype."""
        return self.embed_tokens.weight.dtype

    def wants_decode_plan(self, num_tokens: int = 0) -> bool:
        """Whether `forward` runs a decode-only step's layers in one native call when given the
        step's DecodeStepPlan: native layers of one shape, or the 8-bit step (q8_decode_step.py)
        for a step of `num_tokens` decodes it takes (0: not known yet), and no profiler on (its
        breakdown needs the per-layer calls' ranges, attention apart from the layers).  The
        runner asks the backend for a plan only then."""
        native = self.native_layers
        if native is None or not native.runs_whole_steps:
            if self.q8_step is None or num_tokens > self.q8_step.max_rows:
                return False
        if any(layer.sliding_window for layer in self.layers):
            return False  # the one-call step attends over every layer's whole context
        return not getattr(torch.autograd.profiler, "_is_profiler_enabled", False)  # torch's

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[LayerKVCache],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        decode_plan: DecodeStepPlan | None = None,
        layer_metadata: Sequence[AttentionMetadata] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """`decode_plan` (a decode-only step's, from backend.plan_decode_step): every layer,
        attention included, in one native call where the native layers serve the step.
        `layer_metadata`: each layer's metadata (its KV cache group's), else `metadata` for
        all; each layer's own window is set on it (with_window)."""
        num_tokens = input_ids.shape[0]
        input_ids, positions = self._padded(input_ids), self._padded(positions)
        hidden = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * _multiplier_in(self.config.embedding_multiplier, hidden.dtype)
        cos, sin = self._rope_tables(positions, self.inv_freq, hidden.dtype)
        tables = [(cos, sin)] * len(self.layers)
        if self.inv_freq_local is not None:
            local = self._rope_tables(positions, self.inv_freq_local, hidden.dtype)
            tables = [local if layer.local_rope else (cos, sin) for layer in self.layers]
        kernels, layers = self.kernels, self.layers
        if self._q8_step_serves(decode_plan, num_tokens):
            hidden, cos, sin = (x[:num_tokens].contiguous() for x in (hidden, cos, sin))
            return self.norm(self.q8_step.run_step(layers, hidden, cos, sin, decode_plan))
        if self.native_layers is not None and self.native_layers.serves(hidden.shape[0]):
            kernels = self.native_layers
            if decode_plan is not None and self.wants_decode_plan():
                hidden = kernels.run_step(layers, hidden, cos, sin, num_tokens, decode_plan)
                return self.norm(hidden)[:num_tokens]
        if layer_metadata is not None and len(layer_metadata) != len(layers):
            raise ValueError(
                f"layer_metadata has {len(layer_metadata)} entries for {len(layers)} layers"
            )
        q, k, v = kernels.pre_attention(layers[0], hidden, *tables[0])
        for index, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            layer_md = metadata if layer_metadata is None else layer_metadata[index]
            layer_md = with_window(layer_md, layer.sliding_window)
            with record_function("kvserve::attention"):
                attn = rotation.attend(
                    backend, q[:num_tokens], k[:num_tokens], v[:num_tokens], kv_cache, layer_md,
                    layer.scale, layer.key_offset, layer.key_channel_scale, layer.key_sink,
                )  # fmt: skip
            if index + 1 < len(layers):
                hidden, q, k, v = kernels.between_attentions(
                    layer, layers[index + 1], hidden, attn, *tables[index + 1]
                )
        return self.norm(kernels.post_attention(layers[-1], hidden, attn))[:num_tokens]

    def _q8_step_serves(self, plan: DecodeStepPlan | None, num_tokens: int) -> bool:
        """This decode-only step runs through the 8-bit C step (q8_decode_step.py)."""
        return (
            plan is not None and self.q8_step is not None and not plan.prefix_blocks
            and self.q8_step.serves(num_tokens) and self.wants_decode_plan()
        )  # fmt: skip

    @staticmethod
    def _rope_tables(
        positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim / 2] of the positions, in the activations' dtype."""
        freqs = (positions.to(torch.float32)[:, None] * inv_freq[None, :])[:, None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def _padded(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step's token ids or positions [T], followed by zeros up to the row count that
        the packed projections are asked for (packed_linear.padded_rows).  Each projection
        padded its own input before: four copies a layer, 121 a step, ~7 ms of a 36-row
        decode step with the calls around them.  Padding once here costs the element-wise
        work a few rows more; attention sees the step's tokens only."""
        if not self.pads_rows:
            return tokens
        padding = padded_rows(tokens.shape[0]) - tokens.shape[0]
        return F.pad(tokens, (0, padding)) if padding else tokens

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32, or in the model's dtype with
        upcast=False (the sampler upcasts only when it needs to)."""
        if self.logits_head is not None:
            logits = self.logits_head(hidden)
        else:
            weight = (
                self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
            )
            logits = F.linear(hidden, weight)
        return logits.float() if upcast else logits
