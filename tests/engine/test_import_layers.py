"""How decider's parts import each other: in one direction only, read from the source.

A part is `decider.settings`, `decider.errors`, `decider.invariance`, or a subpackage
(`decider.engine`, `decider.schemas`, `decider.server`). Every import statement counts for the
parts, also inside functions and under TYPE_CHECKING: a lazy or type-only import is still a
dependency, and a cycle hidden that way comes back as soon as someone moves it to the top.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "container" / "decider"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(body: list[ast.stmt], *, everywhere: bool) -> set[str]:
    """The decider modules (and `module.name`s) imported: at import time only, or `everywhere`."""
    found: set[str] = set()
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "decider":
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "decider"}
        elif _is_type_checking(node) and not everywhere:
            continue
        elif everywhere or isinstance(node, ast.If | ast.Try):  # a top-level if/try runs at import
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    found |= _imports(inner, everywhere=everywhere)
    return found


@functools.cache
def _graph(*, everywhere: bool) -> dict[str, set[str]]:
    """Module -> the decider modules it imports."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        imported = _imports(ast.parse(path.read_text(encoding="utf-8")).body, everywhere=everywhere)
        graph[module] = {name for name in imported if name in paths and name != module}
    return graph


def _part_graph() -> dict[str, set[str]]:
    parts: dict[str, set[str]] = defaultdict(set)
    for module, imported in _graph(everywhere=True).items():
        parts[_part(module)] |= {_part(name) for name in imported} - {_part(module)}
    return parts


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as a path (empty: none)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return []

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return []


def test_the_parts_import_each_other_in_one_direction() -> None:
    parts = _part_graph()
    assert {"decider.engine", "decider.settings", "decider.server"} <= set(parts)  # the walk found them
    assert not _cycle(parts), " -> ".join(_cycle(parts))


def test_the_settings_import_nothing_above_them() -> None:
    """The settings are what the engine and the server are configured with (and the CDK stacks read)."""
    assert _part_graph()["decider.settings"] <= {"decider", "decider.errors", "decider.invariance"}


def test_the_engine_imports_no_wire_schema_and_no_server() -> None:
    """The engine hands back readouts; the server makes the responses (decider.server.answers)."""
    wrong = {
        module: sorted(name for name in imported if _part(name) in ("decider.schemas", "decider.server"))
        for module, imported in _graph(everywhere=True).items()
        if _part(module) == "decider.engine"
    }
    assert not {module: names for module, names in wrong.items() if names}


# The engine's parts, bottom first: the model and its prompt; structured output; memory (sequences,
# kept states, the host tier); scheduling (the loop, admission, and the Work protocol it drives);
# the works (decisions, chats); engine.py, which puts them together.
ENGINE_LAYERS = ("model", "structured", "memory", "scheduling", "works", "engine")


def _engine_layer(module: str) -> int:
    """The index in ENGINE_LAYERS of a module under decider.engine (the package itself: above all)."""
    parts = module.split(".")
    return ENGINE_LAYERS.index(parts[2]) if len(parts) > 2 else len(ENGINE_LAYERS)


def test_the_engine_s_parts_import_only_the_parts_below_them() -> None:
    """So the scheduler never reaches into a work, and memory never into the scheduler: each part can
    be read, and tested, with only what is below it."""
    engine = {
        module: imported
        for module, imported in _graph(everywhere=True).items()
        if module.startswith("decider.engine")
    }
    assert {module.split(".")[2] for module in engine if module.count(".") > 1} == set(ENGINE_LAYERS)
    upward = sorted(
        f"{module} -> {name}"
        for module, imported in engine.items()
        for name in imported
        if name.startswith("decider.engine") and _engine_layer(name) > _engine_layer(module)
    )
    assert not upward, "\n".join(upward)


def test_no_module_cycle_at_import_time() -> None:
    graph = _graph(everywhere=False)
    assert not _cycle(graph), " -> ".join(_cycle(graph))


def test_importing_the_settings_loads_no_engine_and_no_native_library() -> None:
    """What the CDK stacks pay for `from decider.settings import Settings`, in a fresh interpreter."""
    probe = (
        "import sys, decider.settings\n"
        "print(sorted(m for m in sys.modules if m.startswith(('decider.engine', 'llama_cpp', 'numpy'))))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
