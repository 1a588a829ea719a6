"""The dependency rule, read from the source: packages import one way, never in a cycle.

    server -> engine -> scheduler -> kv             (the scheduler and its queue: pure Python)
    engine -> executor -> runner -> models -> attention -> kv   (executor: tensor-parallel ranks)
    leaf modules (errors, config, flags, request, step, tokenizer, allocator) import only
    other leaves
    formats (the one config.json / GGUF metadata reader) is a leaf the loader and planner share
    native (the C library: its build, its entry points, the platform and thread plan) sits
    below attention, models and runner and imports leaves only: it knows tensors, not the
    packages that call it

Every `import kvserve...` counts, at module level or inside a function: a lazy import is
still a dependency.  Tools (cli, bench, planner, evaluation) sit outside the serving core.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvserve

ROOT = Path(kvserve.__file__).parent
LEAVES = {"errors", "config", "flags", "request", "step", "tokenizer", "formats", "allocator"}
SERVING = {"kv", "native", "attention", "models", "runner", "executor", "engine"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "allocator": {"errors"},
    "formats": {"errors", "config"},
    "config": {"errors"},
    "flags": {"config", "errors"},
    "request": {"config", "errors"},
    "step": {"request", "config", "errors"},
    "tokenizer": {"config", "errors"},
    "kv": {"config", "errors"},
    "native": {"config", "errors"},
    "attention": {"kv", "native", "config", "errors"},
    "models": {"attention", "native", "kv", "config", "errors", "formats"},
    "runner": {"models", "attention", "native", "kv"} | LEAVES,
    "executor": {"runner", "models", "attention", "native", "kv"} | LEAVES,
    "engine": SERVING | LEAVES,
    "llm": {"engine"} | LEAVES,
    "server": {"engine"} | LEAVES,
    "planner": {"kv"} | LEAVES,
    "bench": {"models"} | LEAVES,
    "evaluation": SERVING | LEAVES,
    # cli -> models: models/paths.py, the model path checked before torch is imported
    "cli": {"server", "engine", "llm", "planner", "bench", "evaluation", "models"} | LEAVES,
    "ray_serve": {"server", "engine"} | LEAVES,  # the Ray Serve deployment (a tool, like cli)
    "__init__": {"llm", "request"},
}
PURE_PYTHON = {"engine/scheduler.py", "engine/request_queue.py", "engine/stopping.py",
               "kv/block_pool.py",
               "kv/prefix_cache.py", "kv/cache_manager.py", "kv/spec.py",
               "kv/miss_reasons.py", "kv/events.py", "kv/cache_log.py",
               "kv/host_tier.py"}  # fmt: skip


def unit_of(path: Path) -> str:
    """kv/spec.py -> kv; config.py -> config."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return parts[0]


def imports_of(path: Path) -> set[str]:
    """Top-level names imported: kvserve units as "kvserve.<unit>", others as their package."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            names.add(".".join(parts[:2]) if parts[0] == "kvserve" else parts[0])
    return names


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        unit = unit_of(path)
        targets = {n.split(".")[1] for n in imports_of(path) if n.startswith("kvserve.")}
        graph.setdefault(unit, set()).update(targets - {unit})
    return graph


def test_every_unit_imports_only_what_the_rule_allows():
    graph = unit_graph()
    assert set(graph) <= set(ALLOWED), f"a new unit needs a rule: {set(graph) - set(ALLOWED)}"
    forbidden = {u: sorted(t - ALLOWED[u]) for u, t in graph.items() if t - ALLOWED[u]}
    assert not forbidden, f"imports against the dependency rule: {forbidden}"


def test_no_import_cycle_between_units():
    graph = unit_graph()
    state: dict[str, str] = {}

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = "open"
        for target in sorted(graph.get(unit, ())):
            assert state.get(target) != "open", f"cycle: {' -> '.join([*path, target])}"
            if target not in state:
                visit(target, [*path, target])
        state[unit] = "done"

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [unit])


def test_the_scheduler_and_kv_bookkeeping_are_pure_python():
    for name in sorted(PURE_PYTHON):
        outside = {n for n in imports_of(ROOT / name) if not n.startswith("kvserve")}
        assert outside <= {"__future__", "collections", "dataclasses", "math", "hashlib",
                           "enum", "typing", "time", "struct", "pickle", "itertools"}, (
            name, outside)  # fmt: skip
        inside = {n.split(".")[1] for n in imports_of(ROOT / name) if n.startswith("kvserve.")}
        assert inside <= {"kv", "step", "request", "errors", "config", "engine"}, (name, inside)
        engine_modules = {
            node.module for node in ast.walk(ast.parse((ROOT / name).read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvserve.engine")
        }  # fmt: skip
        assert engine_modules <= {"kvserve.engine.request_queue", "kvserve.engine.stopping"}, (
            name, engine_modules)  # fmt: skip
