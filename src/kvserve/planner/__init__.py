"""Capacity planner: model + GPU + KV dtype -> weights, KV budget, blocks, max concurrency.

Standard attention layers are counted by ``kvserve.kv.spec.kv_cache_spec`` (the engine's own
function); ``layers`` adds MLA, sliding-window and cache-less layers on top.
"""

from __future__ import annotations

from kvserve.planner.layers import KVLayout, LayerGroup, kv_layout
from kvserve.planner.model import LayerKind, ModelShape, PlanError
from kvserve.planner.plan import (
    DtypePlan,
    KVCapacity,
    Plan,
    PlanInputs,
    engine_kv_capacity,
    kv_capacity,
    make_plan,
)

__all__ = [
    "DtypePlan",
    "KVCapacity",
    "KVLayout",
    "LayerGroup",
    "LayerKind",
    "ModelShape",
    "Plan",
    "PlanError",
    "PlanInputs",
    "engine_kv_capacity",
    "kv_capacity",
    "kv_layout",
    "make_plan",
]
