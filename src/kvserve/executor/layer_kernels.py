"""Which path the layers' work between attentions takes, chosen once at start-up by every rank:
the native path where it serves the model (models/native_layers.py: every step, no compiler
needed), else torch.compile of the layers, else eager; eager only with --enforce-eager.

One rank: a path that fails its warm-up leaves the next one, with a warning, never a failed
start.  N ranks cannot fall back apart: a compile that fails on one rank in the middle of the
warm-up leaves it out of step with the others' collectives.  So before compiling every rank
compiles one layer's pre-attention work (no collective in it) and the ranks agree: where any
rank cannot compile (no C++ compiler, an unsupported op), all run eagerly; a compile that
fails later ends the start-up (ExecutorFailedError names the rank), as any other failure in a
collective call does.  The native path is not taken with N ranks (executor/base.py
NOT_WITH_TENSOR_PARALLEL).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from kvserve.executor.base import tensor_parallel_refuses
from kvserve.models.llama import EAGER, pre_attention

logger = logging.getLogger("kvserve")

PROBE_ROWS = 16  # the probe's token count (one whole row tile of the packed projections)


def choose_layer_kernels(
    model: nn.Module,
    warm_up: Callable[[], None],
    enforce_eager: bool,
    world_size: int,
    all_ranks: Callable[[bool], bool],
) -> None:
    """Set the model's layer path.  `warm_up` runs a few steps through it (the runner's);
    `all_ranks(ok)` is True when `ok` is True on every rank (a collective with N ranks)."""
    if enforce_eager:
        return
    _choose_between_attentions(model, warm_up, world_size, all_ranks)
    _q8_decode_step_warmed_up(model, warm_up, world_size)


def _q8_decode_step_warmed_up(
    model: nn.Module, warm_up: Callable[[], None], world_size: int
) -> None:
    """A float32 model over 8-bit weights takes its few-row decode steps in one C call
    (models/q8_decode_step.py) where it can, warmed up here; one that fails is dropped."""
    if world_size > 1 or not model.use_q8_decode_step():
        return
    try:
        warm_up()
    except Exception as exc:  # noqa: BLE001 - any failure: the per-layer path serves
        logger.warning("the 8-bit decode step failed, decoding layer by layer (%s: %s)",
                       type(exc).__name__, _first_line(exc))  # fmt: skip
        model.q8_step = None
        return
    logger.info("decode steps of up to %d rows run in one call (decode_step_q8.c)",
                model.q8_step.max_rows)  # fmt: skip


def _choose_between_attentions(
    model: nn.Module,
    warm_up: Callable[[], None],
    world_size: int,
    all_ranks: Callable[[bool], bool],
) -> None:
    """The native layers, torch.compile or eager layers, as the module docstring says."""
    if _native_layers_warmed_up(model, warm_up, world_size):
        logger.info("the layers run their native path (native/csrc/layer/decode_layer.c)")
        return
    if world_size > 1 and not all_ranks(_compiles_here(model)):
        logger.warning("torch.compile cannot run on every rank: the ranks run eagerly")
        return
    started = time.monotonic()
    model.compile()
    try:
        warm_up()
    except Exception as exc:  # noqa: BLE001 - one rank: any compiler failure, fall back to eager
        if world_size > 1:
            raise
        logger.warning("torch.compile failed, running eagerly (%s: %s)", type(exc).__name__,
                       _first_line(exc))  # fmt: skip
        model.kernels = EAGER
        return
    logger.info("compiled the layers with torch.compile in %.1fs", time.monotonic() - started)


def _native_layers_warmed_up(
    model: nn.Module, warm_up: Callable[[], None], world_size: int
) -> bool:
    """The layers' C path where it serves this model, warmed up here.  One that fails leaves
    the model to torch.compile."""
    if tensor_parallel_refuses("native layers", world_size) or not model.use_native_layers():
        return False
    try:
        warm_up()
    except Exception as exc:  # noqa: BLE001 - any failure: compile the layers instead
        logger.warning("the native layers failed, compiling the layers instead (%s: %s)",
                       type(exc).__name__, _first_line(exc))  # fmt: skip
        model.native_layers = None
        return False
    return True


@torch.inference_mode()
def _compiles_here(model: nn.Module) -> bool:
    """torch.compile of the first layer's pre-attention work on this rank, on zeros (where the
    compiler cannot run, every later compile fails too; inductor's cache keeps the graph)."""
    layer, weight = model.layers[0], model.norm.weight
    hidden = weight.new_zeros((PROBE_ROWS, weight.shape[0]))
    cos = sin = weight.new_zeros((PROBE_ROWS, 1, layer.head_dim // 2))
    try:
        torch.compile(pre_attention, dynamic=True)(layer, hidden, cos, sin)
    except Exception as exc:  # noqa: BLE001 - any compiler failure
        logger.warning("torch.compile failed on this rank (%s: %s)", type(exc).__name__,
                       _first_line(exc))  # fmt: skip
        return False
    return True


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""
