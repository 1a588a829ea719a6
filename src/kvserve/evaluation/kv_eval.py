"""Compare KV cache dtypes on one model: perplexity and greedy agreement per dtype.

The model is loaded once; each dtype gets its own freshly allocated cache.  The first dtype
of the list is the reference the others are compared with (`auto` by default: the model's
own dtype, i.e. an unquantized cache).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch

from kvserve.config import EngineConfig, ModelConfig
from kvserve.errors import ParameterError
from kvserve.evaluation import greedy, perplexity
from kvserve.evaluation.paged import allocate_cache, check_kv_dtypes, make_spec
from kvserve.evaluation.settings import EvalSettings
from kvserve.executor.kv_dtype_check import canary_token_ids
from kvserve.models.loader import load_checkpoint
from kvserve.models.quantized_linear import q8_plan
from kvserve.models.registry import get_model_class
from kvserve.native import platform
from kvserve.runner.key_offsets import calibrate_key_offsets
from kvserve.tokenizer import load_tokenizer

logger = logging.getLogger("kvserve")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: object
    dtype: torch.dtype
    device: torch.device
    name: str


@dataclass(frozen=True)
class KVDtypeResult:
    kv_dtype: str  # as given (auto, fp8, ...)
    storage_dtype: str  # resolved (float32, fp8_e4m3, ...)
    bytes_per_token: int
    perplexity: float
    num_predicted: int
    relative_perplexity: float  # perplexity / reference perplexity - 1
    mean_kl: float  # mean KL(reference || this) of the next-token distributions, nats
    agreement: float  # share of identical greedy tokens, position by position
    mean_identical_prefix: float
    num_prompts_identical: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def load_model(config: EngineConfig, weight_dtype: str | None = None) -> LoadedModel:
    """The engine's model loading, without the scheduler or a sized cache; its weights as
    `weight_dtype` (else --weight-dtype) says."""
    platform.set_cpu_threads()
    checkpoint = load_checkpoint(config.load.model)
    device = platform.resolve_device(config.load.device)
    dtype = platform.resolve_dtype(config.load.dtype, device, checkpoint.config.torch_dtype)
    model_cls = get_model_class(checkpoint.config.architecture)
    q8 = q8_plan(weight_dtype or config.load.weight_dtype, device, dtype,
                 checkpoint.config.stored_weight_type)  # fmt: skip
    model = model_cls.from_weights(checkpoint.config, checkpoint.weights, dtype, device, q8)
    tokenizer = load_tokenizer(checkpoint.path)
    # A 4-bit cache's key offsets, as the engine measures them (used by rotated caches only).
    calibrate_key_offsets(model, canary_token_ids(tokenizer), device)
    return LoadedModel(model, checkpoint.config, tokenizer, dtype, device, checkpoint.name)


def sample_prompts(token_ids: list[int], num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`num_prompts` slices of `prompt_len` tokens at evenly spaced offsets of the text."""
    if num_prompts == 0:
        return []
    if len(token_ids) < prompt_len:
        raise ParameterError("--prompt-len", f"exceeds the text's {len(token_ids)} tokens")
    span = len(token_ids) - prompt_len
    offsets = [span * i // max(1, num_prompts - 1) for i in range(num_prompts)]
    return [token_ids[o : o + prompt_len] for o in offsets]


def evaluate_kv_dtypes(
    loaded: LoadedModel, token_ids: list[int], kv_dtypes: list[str], settings: EvalSettings
) -> list[KVDtypeResult]:
    """Perplexity, KL divergence and greedy agreement for each dtype; the first one is the
    reference.  The perplexity runs every dtype's cache in lockstep (the KL divergence needs
    the reference's distributions position by position); `seconds` is a dtype's greedy run
    plus its share of that."""
    check_kv_dtypes(kv_dtypes)
    _check_lengths(loaded.config, settings)
    limit = settings.max_eval_tokens or len(token_ids)
    started = time.monotonic()
    ppls = _perplexities(loaded, kv_dtypes, token_ids[:limit], settings)
    ppl_share = (time.monotonic() - started) / len(kv_dtypes)
    prompts = sample_prompts(token_ids, settings.num_prompts, settings.prompt_len)
    results: list[KVDtypeResult] = []
    reference_tokens: list[list[int]] = []
    for kv_dtype, ppl in zip(kv_dtypes, ppls, strict=True):
        started = time.monotonic()
        generated = _generate(loaded, kv_dtype, prompts, settings)
        if not results:
            reference_tokens = generated
        agreement = greedy.greedy_agreement(reference_tokens, generated)
        spec = make_spec(loaded.config, kv_dtype, loaded.dtype, settings.block_size)
        results.append(
            KVDtypeResult(
                kv_dtype=kv_dtype,
                storage_dtype=spec.dtype,
                bytes_per_token=spec.bytes_per_token,
                perplexity=ppl.perplexity,
                num_predicted=ppl.num_predicted,
                relative_perplexity=ppl.perplexity / ppls[0].perplexity - 1.0,
                mean_kl=ppl.mean_kl,
                agreement=agreement.share,
                mean_identical_prefix=agreement.mean_identical_prefix,
                num_prompts_identical=agreement.num_prompts_identical,
                seconds=time.monotonic() - started + ppl_share,
            )
        )
        logger.info("eval-kv %s: perplexity %.4f, KL %.5f, agreement %.3f", kv_dtype,
                    ppl.perplexity, ppl.mean_kl, agreement.share)  # fmt: skip
    return results


def _check_lengths(config: ModelConfig, settings: EvalSettings) -> None:
    """Positions beyond the model's context would measure RoPE extrapolation, not the cache."""
    native = config.max_position_embeddings
    if settings.context_len > native:
        raise ParameterError(
            "--context-len", f"{settings.context_len} exceeds the model's {native}"
        )
    if settings.prompt_len + settings.max_tokens > native:
        raise ParameterError(
            "--prompt-len", f"+ --max-tokens exceed the model's context of {native}"
        )


def _perplexities(
    loaded: LoadedModel, kv_dtypes: list[str], token_ids: list[int], settings: EvalSettings
) -> list[perplexity.PerplexityResult]:
    context_len, chunk_size = settings.context_len, settings.chunk_size
    num_blocks = perplexity.cache_blocks_needed(context_len, chunk_size, settings.block_size)
    caches = [
        allocate_cache(
            loaded.config, kv_dtype, loaded.dtype, settings.block_size, num_blocks, loaded.device
        )
        for kv_dtype in kv_dtypes
    ]
    return perplexity.compare(
        loaded.model, caches, token_ids, context_len, chunk_size, loaded.device
    )


def _generate(
    loaded: LoadedModel, kv_dtype: str, prompts: list[list[int]], settings: EvalSettings
) -> list[list[int]]:
    if not prompts:
        return []
    num_blocks = greedy.cache_blocks_needed(
        len(prompts), settings.prompt_len, settings.max_tokens, settings.block_size
    )
    cache = allocate_cache(
        loaded.config, kv_dtype, loaded.dtype, settings.block_size, num_blocks, loaded.device
    )
    return greedy.greedy_generate(
        loaded.model, cache, prompts, settings.max_tokens, settings.chunk_size, loaded.device
    )
