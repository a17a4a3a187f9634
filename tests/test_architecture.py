"""The import graph as docs/architecture.md draws it, read from the sources with ``ast``: no
circle, no module importing a layer above its own, the engine core seeing the backends only
through their interface, the reference knowing nothing of the engine."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "reference", "model_loader")

# lowest first, as docs/architecture.md lists them; the longest matching prefix decides
LAYERS = (
    ("engine.config", "engine.sampling_params", "engine.structured_params",
     "engine.pooling_params", "engine.outputs", "engine.utils", "engine.tracing",
     "engine.golden", "model_loader", "reference"),
    ("engine.kernels",),
    ("engine.devices", "engine.emulation"),
    ("engine.backends",),
    ("engine.executor", "engine.kv_offload", "engine.lora"),
    ("engine.core",),
    ("engine.frontend",),
    ("engine.entrypoints",),
    ("engine.tools", "engine"),
)  # fmt: skip
# what the core may import of the backends: the interface, not an implementation
BACKEND_INTERFACE = {
    "engine.backends.base",
    "engine.backends.forward_batch",
    "engine.backends.kv_groups",  # the KV groups' layout, which the step's batch carries
}
MAX_LINES = 500  # any Python file of engine/ or reference/
SMALLER = {"engine/core/engine_core.py": 350, "engine/frontend/llm_engine.py": 250}


def module_files() -> dict[str, Path]:
    """Dotted module name -> its file, for every Python file of PACKAGES."""
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def imported_names(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Every dotted name an import anywhere in ``tree`` (functions included) may refer to."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of PACKAGES it imports (the longest module prefix of each name)."""
    mods = module_files()
    graph = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = set()
        for name in imported_names(tree, mod, path.name == "__init__.py"):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod:
                targets.add(name)
        graph[mod] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return cycles


def layer_of(module: str) -> int:
    best, length = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > length:
                best, length = i, len(p)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best


def test_the_cycle_finder_finds_a_circle_and_only_a_circle():
    chain = {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"d"}}
    assert find_cycles(chain) == []
    assert find_cycles({**chain, "c": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"x": {"y"}, "y": {"x"}, "z": {"x"}}) == [["x", "y"]]


def test_no_import_goes_round_in_a_circle():
    graph = import_graph()
    assert "engine.kv_offload.tier" in graph["engine.kv_offload.host_tier"]  # edges are read
    assert find_cycles(graph) == []


def test_no_module_imports_a_layer_above_its_own():
    graph = import_graph()
    up = [
        f"{m} (layer {layer_of(m) + 1}) imports {t} (layer {layer_of(t) + 1})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if layer_of(t) > layer_of(m)
    ]
    assert up == []


def test_the_core_sees_the_backends_only_through_their_interface():
    graph = import_graph()
    seen = {
        f"{m} imports {t}"
        for m, targets in graph.items()
        if m.startswith("engine.core")
        for t in targets
        if t.startswith("engine.backends") and t not in BACKEND_INTERFACE
    }
    assert seen == set()
    reference = {t for m, ts in graph.items() if m.startswith("reference") for t in ts}
    assert not {t for t in reference if t.startswith("engine")}


def test_no_file_is_over_its_length():
    files = [p for pkg in ("engine", "reference") for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 100  # the walk found the packages
    long = []
    for path in files:
        name = path.relative_to(ROOT).as_posix()
        limit = SMALLER.get(name, MAX_LINES + 1)  # at most MAX_LINES; under SMALLER's
        lines = len(path.read_text().splitlines())
        if lines >= limit:
            long.append(f"{name}: {lines} lines (limit {limit - 1})")
    assert long == []
