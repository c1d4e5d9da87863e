"""No import cycles among localllm's modules, and the server's modules in floors.

Every `import` and `from ... import` in the source tree is read with `ast` (function-level imports
included, since they still tie two modules together), giving a module graph; any strongly connected
group of modules is a cycle. Imports under `if TYPE_CHECKING:` never run, so they do not count for
cycles in general; for the server's floors they do (a type names what a module depends on).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package name it installs under (see [tool.setuptools] package-dir).
PACKAGES = {"localllm": "localllm", "kernels": "localllm.kernels", "quant": "localllm.quant"}


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the installed packages."""
    modules: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST, typing: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, at any depth, except those inside `if TYPE_CHECKING:`
    (those too with `typing`)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child) and not typing:
            yield from (n for c in child.orelse for n in _import_nodes_of(c))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child, typing)


def _import_nodes_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _import_nodes(node)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a `from` import names, with relative imports resolved against `module`."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, path: Path, known: set[str], typing: bool = False) -> set[str]:
    """The localllm modules that `module` imports (a `from pkg import sub` counts as pkg.sub); with
    `typing`, imports under `if TYPE_CHECKING:` too."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in _import_nodes(tree, typing):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        target = _absolute(node, module, path.name == "__init__.py")
        subs = {f"{target}.{alias.name}" for alias in node.names} & known
        found.update(subs or {target})
        if len(subs) < len(node.names):  # some names are attributes of `target` itself
            found.add(target)
    return {name for name in found if name in known and name != module}


@functools.cache  # read once for all the tests (nobody changes it)
def import_graph(typing: bool = False) -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {module: imports_of(module, path, known, typing) for module, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_scan_sees_imports_of_every_kind():
    graph = import_graph()
    assert "localllm.kernels.packing" in graph and "localllm.quant" in graph
    # a function-level import (the registry fetches through download only when asked to)
    assert "localllm.download" in graph["localllm.registry"]
    # `from localllm.cli import common` is an edge to the submodule
    assert "localllm.cli.common" in graph["localllm.cli.bench"]


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_cycles_even_through_type_only_imports():
    found = cycles(import_graph(typing=True))
    assert found == [], "import cycles (type-only included): " + "; ".join(" <-> ".join(c) for c in found)


# ---- the loading package ----------------------------------------------------------------------------

LOADING = "localllm.loading"
# localllm.loading's modules, lowest floor first; each imports only from floors below its own.
LOADING_FLOORS: tuple[tuple[str, ...], ...] = (
    ("index",),  # TensorInfo, GGUFIndex
    ("checks",),  # tensor bytes, metadata
    ("parser",),  # the bounded header parser
    ("cache",),  # the on-disk index cache
    ("splits",),  # gguf-split sets
    ("file",),  # the GGUFFile facade
)
# What the loading package may reach, directly or not, outside itself: formats and helpers, never
# the models, backends, engine, server, CLI or model_info above it.
BELOW_LOADING = ("localllm.errors", "localllm.text_table", "localllm.printable", "localllm.architectures")


def _reached_from(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_loading_reaches_nothing_above_it():
    graph = import_graph(typing=True)
    roots = [m for m in graph if m == LOADING or m.startswith(LOADING + ".")]
    assert len(roots) == 1 + sum(len(floor) for floor in LOADING_FLOORS)
    outside = {
        m
        for m in _reached_from(graph, roots)
        if not m.startswith((LOADING, "localllm.quant")) and m not in BELOW_LOADING
    }
    assert outside == set(), "localllm.loading reaches upward: " + ", ".join(sorted(outside))


def test_loading_imports_go_down_its_floors():
    prefix = LOADING + "."
    graph = {
        m.removeprefix(prefix): {t.removeprefix(prefix) for t in targets if t.startswith(prefix)}
        for m, targets in import_graph(typing=True).items()
        if m.startswith(prefix)
    }
    found = layering_violations(graph, LOADING_FLOORS, ())
    assert found == [], "loading imports against its floors: " + "; ".join(found)


# ---- the server's floors ----------------------------------------------------------------------------

SERVER = "localllm.server"
# One module per endpoint family: each imports only from the floors below, never another endpoint.
ENDPOINTS = ("chat", "completions", "embeddings", "health", "messages", "models", "responses", "tokens")
# localllm.server's modules, lowest floor first. A module imports from its own floor or below, never
# from above; endpoint modules not even from each other.
SERVER_FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "logs", "metrics", "webui"),  # error shapes and handlers, log filter, metrics, chat page
    ("protocol", "replies", "responses_protocol", "guards", "connections", "cache_breaks"),  # wire; guards
    ("tool_calls", "tool_stream", "structured_output", "streaming"),  # tools, constraints, SSE framing
    ("jobs",),  # submission, collection, streams on the engine thread
    ("state",),  # ServerConfig, ServerState
    ("model_pool",),  # the served models: loaded on demand, leased, unloaded when idle
    ("pipeline",),  # validation, parameters, prompts, submission
    ENDPOINTS,
    ("app", "runner"),  # the route table and lifespan; uvicorn
)


def layering_violations(
    graph: dict[str, set[str]], floors: tuple[tuple[str, ...], ...], peers_apart: tuple[str, ...]
) -> list[str]:
    """Each import from a lower floor to a higher one, or between two modules of `peers_apart`."""
    floor_of = {name: i for i, floor in enumerate(floors) for name in floor}
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            upward = floor_of[target] > floor_of[module]
            if upward or (target != module and module in peers_apart and target in peers_apart):
                found.append(f"{module} -> {target}")
    return found


def server_graph(typing: bool = True) -> dict[str, set[str]]:
    """The server's modules by short name (webui's package as `webui`), and their imports among them."""
    prefix = SERVER + "."

    def short(name: str) -> str:
        return name.removeprefix(prefix).split(".")[0]

    graph: dict[str, set[str]] = {}
    for module, targets in import_graph(typing).items():
        if module.startswith(prefix):
            inside = {short(t) for t in targets if t.startswith(prefix)}
            graph.setdefault(short(module), set()).update(inside - {short(module)})
    return graph


def test_the_layering_check_finds_upward_and_sideways_imports():
    floors = (("low",), ("a", "b"), ("top",))
    graph = {"low": {"top"}, "a": {"b", "low"}, "b": set(), "top": {"a"}}
    assert layering_violations(graph, floors, ("a", "b")) == ["a -> b", "low -> top"]
    # type-only imports are seen when asked for: tool_stream names tool_calls.ToolPlan only in types
    assert "localllm.server.tool_calls" in import_graph(typing=True)["localllm.server.tool_stream"]
    assert "localllm.server.tool_calls" not in import_graph()["localllm.server.tool_stream"]


def test_every_server_module_has_a_floor():
    placed = [name for floor in SERVER_FLOORS for name in floor]
    assert len(placed) == len(set(placed))
    assert set(server_graph()) == set(placed)


def test_server_imports_go_down_only():
    found = layering_violations(server_graph(), SERVER_FLOORS, ENDPOINTS)
    assert found == [], "server imports against the floors (type-only included): " + "; ".join(found)


def test_server_has_no_cycles_even_through_type_only_imports():
    found = cycles(server_graph())
    assert found == [], "server import cycles: " + "; ".join(" <-> ".join(c) for c in found)
