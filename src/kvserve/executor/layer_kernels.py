"""Which path the layers' work between attentions takes, chosen once at start-up by every rank:
the native path where it serves the model (models/native_layers.py: every step, no compiler
needed), else torch.compile of the layers, else eager; nothing but eager with --enforce-eager
or where N ranks refuse a path (executor/base.py NOT_WITH_TENSOR_PARALLEL).  A path that
fails its warm-up on one rank leaves the next one, with a warning, never a failed start."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from torch import nn

from kvserve.executor.base import tensor_parallel_refuses
from kvserve.models.llama import EAGER

logger = logging.getLogger("kvserve")


def choose_layer_kernels(
    model: nn.Module, warm_up: Callable[[], None], enforce_eager: bool, world_size: int
) -> None:
    """Set the model's layer path; `warm_up` runs a few steps through it (the runner's)."""
    if enforce_eager:
        return
    if _native_layers_warmed_up(model, warm_up, world_size):
        logger.info("the layers run their native path (csrc/decode_layer.c) at every step")
        return
    if tensor_parallel_refuses("torch.compile", world_size):
        return
    started = time.monotonic()
    model.compile()
    try:
        warm_up()
    except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back to eager
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


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""
