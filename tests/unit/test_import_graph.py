"""The dependency rule, read from the source: packages import one way, never in a cycle.

    server -> engine -> scheduler -> kv             (the scheduler and its queue: pure Python)
    engine -> executor -> runner -> models -> attention -> kv   (executor: every rank's Worker)
    the engine reaches the model only through the executor: it imports none of runner, models
    and attention (so neither the model's code nor the C kernels' loader is the engine's)
    leaf modules (errors, config, flags, request, step, tokenizer, allocator) import only
    other leaves, and request also kv/block_hasher.py (a request owns its block hashes)
    formats (the one config.json / GGUF metadata reader) is a leaf the loader and planner share
    native (the C library: its build, its entry points, the platform and thread plan) sits
    below attention, models and runner and imports leaves only: it knows tensors, not the
    packages that call it

Every `import kvserve...` counts, at module level or inside a function: a lazy import is
still a dependency.  Tools (cli, bench, planner, evaluation) sit outside the serving core.
Cycles are checked twice: between units (packages and top-level modules) and between modules
(a cycle inside one package, which the unit graph cannot see).  A package's `__init__.py` is a
module like the others: importing `kvserve.kv.spec` is an edge to kv/spec.py only, not to the
packages Python initializes on the way.

kv/ is pure Python as a folder rule: every module in it, and every module those import,
imports only the standard library (no torch: the 8-bit KV formats live in kv_quant.py).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import kvserve

ROOT = Path(kvserve.__file__).parent
LEAVES = {"errors", "config", "flags", "request", "step", "tokenizer", "formats", "allocator"}
SERVING = {"kv", "kv_quant", "native", "attention", "models", "runner", "executor", "engine"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "allocator": {"errors"},
    "formats": {"errors", "config"},
    "config": {"errors"},
    "flags": {"config", "errors"},
    # a request owns its block hashes (kv/block_hasher.py, pure Python, importing nothing of
    # kvserve), so the cache manager reads them from the request instead of taking a cache
    # salt at every call; kv never imports request (it reads a request through a Protocol),
    # so this edge makes no cycle.  LEAF_KV_MODULES narrows it to that one module.
    "request": {"config", "errors", "kv"},
    "step": {"request", "config", "errors"},
    "tokenizer": {"config", "errors"},
    "kv": {"config", "errors"},
    "native": {"config", "errors"},
    # kv_quant: the quantized KV formats (torch only), read by attention, the executor's KV
    # dtype check and the evaluation
    "kv_quant": set(),
    "attention": {"kv", "kv_quant", "native", "config", "errors"},
    "models": {"attention", "native", "kv", "config", "errors", "formats"},
    "runner": {"models", "attention", "native", "kv"} | LEAVES,
    "executor": {"runner", "models", "attention", "kv_quant", "native", "kv"} | LEAVES,
    # structured: constrained decoding's grammars and matchers (numpy, llguidance; no
    # torch), which the engine steps and the server validates requests with
    "structured": LEAVES,
    "engine": {"executor", "kv", "structured"} | LEAVES,
    "llm": {"engine"} | LEAVES,
    "server": {"engine", "structured"} | LEAVES,
    "planner": {"kv"} | LEAVES,
    # bench -> kv: bench/kv_sim.py replays traces over the cache manager (like the planner)
    "bench": {"models", "kv"} | LEAVES,
    "evaluation": SERVING | LEAVES,
    # cli -> models: models/paths.py, the model path checked before torch is imported
    "cli": {"server", "engine", "llm", "planner", "bench", "evaluation", "models"} | LEAVES,
    "ray_serve": {"server", "engine"} | LEAVES,  # the Ray Serve deployment (a tool, like cli)
    "__init__": {"llm", "request"},
}
LEAF_KV_MODULES = {"kvserve.kv.block_hasher"}  # the only kv module a leaf may import
PURE_FOLDERS = ("kv",)  # every module, now and later
PURE_MODULES = ("engine/scheduler.py", "engine/request_queue.py", "engine/stopping.py",
                "engine/scheduling_policy.py")  # fmt: skip
PURE_STDLIB = {"__future__", "collections", "dataclasses", "math", "hashlib", "enum", "typing",
               "time", "struct", "pickle", "itertools", "heapq"}  # fmt: skip


def pure_python_files() -> list[Path]:
    files = [p for folder in PURE_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    return files + [ROOT / name for name in PURE_MODULES]


def unit_of(path: Path) -> str:
    """kv/spec.py -> kv; config.py -> config."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return parts[0]


def module_of(path: Path) -> str:
    """kv/spec.py -> kvserve.kv.spec; kv/__init__.py -> kvserve.kv."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_of(p): p for p in ROOT.rglob("*.py")}


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, fully named: `from a.b import c` is a.b.c when that is a
    module (else a.b); relative imports are resolved against the file's package."""
    package = module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                names.add(sub if sub in MODULES else module)
    return names


def imports_of(path: Path) -> set[str]:
    """Top-level names imported: kvserve units as "kvserve.<unit>", others as their package."""
    names = set()
    for module in imported_modules(path):
        parts = module.split(".")
        names.add(".".join(parts[:2]) if parts[0] == "kvserve" else parts[0])
    return names


def module_graph() -> dict[str, set[str]]:
    """kvserve module -> the kvserve modules it imports."""
    return {name: imported_modules(path) & set(MODULES) for name, path in MODULES.items()}


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


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target, [*path, target])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_find_cycle_reports_the_cycle_only():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": set()}
    assert find_cycle(graph) == ["b", "c", "b"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_units():
    cycle = find_cycle(unit_graph())
    assert cycle is None, f"cycle: {' -> '.join(cycle)}"


def test_no_import_cycle_between_modules():
    cycle = find_cycle(module_graph())
    assert cycle is None, f"cycle: {' -> '.join(cycle)}"


def test_a_leaf_imports_only_the_block_hasher_of_kv():
    for name, path in MODULES.items():
        if unit_of(path) in LEAVES:
            kv = {m for m in imported_modules(path) if m.startswith("kvserve.kv")}
            assert kv <= LEAF_KV_MODULES, (name, kv)


def test_the_scheduler_and_kv_bookkeeping_are_pure_python():
    """Direct imports: the few standard modules bookkeeping needs, and kvserve's leaves, kv
    and the scheduler's own queue, policies and stop check."""
    for path in pure_python_files():
        name = path.relative_to(ROOT)
        outside = {n for n in imports_of(path) if not n.startswith("kvserve")}
        assert outside <= PURE_STDLIB, (name, outside)
        inside = {n.split(".")[1] for n in imports_of(path) if n.startswith("kvserve.")}
        assert inside <= {"kv", "step", "request", "errors", "config", "engine"}, (name, inside)
        engine_modules = {m for m in imported_modules(path) if m.startswith("kvserve.engine")}
        assert engine_modules <= {"kvserve.engine.request_queue", "kvserve.engine.stopping",
                                  "kvserve.engine.scheduling_policy"}, (
            name, engine_modules)  # fmt: skip


def test_kv_is_pure_python_down_to_every_module_it_reaches():
    """The folder rule, transitively: no module that kv/ (or the scheduler) reaches through
    kvserve imports a package outside the standard library."""
    graph = module_graph()
    seen: set[str] = set()
    todo = [module_of(p) for p in pure_python_files()]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    stdlib = set(sys.stdlib_module_names)
    for module in sorted(seen):
        imported = imports_of(MODULES[module])
        outside = {n for n in imported if n != "kvserve" and not n.startswith("kvserve.")}
        assert outside <= stdlib, (module, outside - stdlib)


def test_importing_kv_and_the_scheduler_loads_no_torch():
    """What the source rules promise, at run time (the packages Python initializes included)."""
    modules = sorted(module_of(p) for p in pure_python_files())
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\n"
        "print(sorted(n for n in ('torch', 'numpy') if n in sys.modules))"
    )
    path = os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_structured_outputs_load_no_torch():
    """The grammar side of constrained decoding is numpy and llguidance: no torch."""
    code = (
        "import sys\nimport kvserve.structured.manager, kvserve.structured.grammar\n"
        "print('torch' in sys.modules)"
    )
    path = os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_the_engine_reaches_the_model_only_through_the_executor():
    assert not unit_graph()["engine"] & {"runner", "models", "attention"}
