"""The import layers, read from the code itself (ast): no module imports one of a higher layer, the engine and the
gateway never import each other, and no modules import each other in a circle.

The layers, bottom up (ARCHITECTURE.md):
  0 ladle_kernels           tensors and plain values; their own input types (ladle_kernels.attention_inputs)
  1 ladle.v1                the generated gRPC stubs
  2 ladle, ladle.client, ladle.log    the typed client over the stubs, and logging setup (all of clients/)
  3 engine_server           the engine, serving the stubs' service
  4 gateway                 the OpenAI HTTP gateway, calling engines through the stubs and the client
  5 ladle_cli               the `ladle` command (main, serve, batch_file, engine_child): wires engine and gateway
  6 benchmarks              on top of everything
Every import counts, those under `if TYPE_CHECKING:` and inside functions too: an arrow is an arrow.
"""

from __future__ import annotations

import ast
import importlib.metadata
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {  # import name -> folder
    "ladle_kernels": ROOT / "ladle_kernels",
    "engine_server": ROOT / "engine_server",
    "gateway": ROOT / "gateway",
    "ladle": ROOT / "clients" / "ladle",
    "ladle_cli": ROOT / "ladle_cli",
    "benchmarks": ROOT / "benchmarks",
}
NEVER_EACH_OTHER = ("engine_server", "gateway")


def layer(module: str) -> int:
    """The layer of a module of this tree (module docstring)."""
    top = module.split(".")[0]
    if top == "ladle_kernels":
        return 0
    if module == "ladle.v1" or module.startswith("ladle.v1."):
        return 1
    if top == "ladle":
        return 2
    if top == "engine_server":
        return 3
    if top == "gateway":
        return 4
    if top == "ladle_cli":
        return 5
    if top == "benchmarks":
        return 6
    raise ValueError(f"{module} is in no layer")


def find_modules(packages: Mapping[str, Path]) -> dict[str, Path]:
    """Every module of the packages: dotted name -> file (a package by its __init__.py)."""
    modules = {}
    for name, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> Iterator[tuple[str, int]]:
    """(module of this tree, line) for each import in `path`; `from package import submodule` names the submodule,
    an imported name that is not a module names the module it comes from."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join([*here, base] if base else here)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name, node.lineno


def import_graph(packages: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line importing it}."""
    modules = find_modules(packages)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for target, line in imports_of(module, path, modules):
            edges.setdefault(target, line)
    return graph


def back_imports(graph: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Each import of a higher layer's module, and each between the engine and the gateway, as 'a:line -> b'."""
    found = []
    for module, edges in graph.items():
        for target, line in edges.items():
            crossing = {module.split(".")[0], target.split(".")[0]} == set(NEVER_EACH_OTHER)
            if layer(target) > layer(module) or crossing:
                found.append(f"{module}:{line} -> {target}")
    return sorted(found)


def circles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph.get(target, {}))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_no_import_runs_up_a_layer_or_between_engine_and_gateway() -> None:
    graph = import_graph(PACKAGES)
    assert len(graph) > 150  # the whole tree was read
    assert back_imports(graph) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert circles(import_graph(PACKAGES)) == []


def test_no_installed_distribution_but_ladle_provides_a_top_level_package_of_ours() -> None:
    """Two distributions with one top-level import name overwrite each other's files and import whichever comes
    first on sys.path (this is why the kernels are `ladle_kernels`: transformers 5.25 requires Hugging Face's
    `kernels`). Every installed distribution is checked against the import names of this tree."""
    providers = importlib.metadata.packages_distributions()
    foreign = {name: sorted(set(providers[name]) - {"ladle"}) for name in PACKAGES if name in providers}
    assert {name: dists for name, dists in foreign.items() if dists} == {}
    assert "ladle_kernels" in foreign  # the project itself is installed (editable), so the check saw its names


def _tree(tmp_path: Path, files: Mapping[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {top: tmp_path / top for top in {name.split("/")[0] for name in files}}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from engine_server.attention import Meta\n", ["ladle_kernels.ops:1 -> engine_server.attention"]),
        (
            "if TYPE_CHECKING:\n    from engine_server import attention\n",
            ["ladle_kernels.ops:2 -> engine_server.attention"],
        ),
        ("def f():\n    import gateway.app\n", ["ladle_kernels.ops:2 -> gateway.app"]),
        ("from ladle_kernels import ref\n", []),
    ],
)
def test_a_back_import_is_caught(tmp_path: Path, source: str, expected: list[str]) -> None:
    packages = _tree(tmp_path, {
        "ladle_kernels/__init__.py": "", "ladle_kernels/ref.py": "", "ladle_kernels/ops.py": source,
        "engine_server/__init__.py": "", "engine_server/attention.py": "from ladle_kernels import ops\n",
        "gateway/__init__.py": "", "gateway/app.py": "",
    })  # fmt: skip
    assert back_imports(import_graph(packages)) == expected


def test_the_engine_and_the_gateway_may_not_import_each_other(tmp_path: Path) -> None:
    packages = _tree(tmp_path, {
        "engine_server/__init__.py": "", "engine_server/core.py": "",
        "gateway/__init__.py": "", "gateway/app.py": "from engine_server.core import Engine\n",
    })  # fmt: skip
    assert back_imports(import_graph(packages)) == ["gateway.app:1 -> engine_server.core"]


def test_a_circle_is_caught_and_a_package_importing_its_own_modules_is_not_one(tmp_path: Path) -> None:
    packages = _tree(tmp_path, {
        "gateway/__init__.py": "from gateway.a import A\n",
        "gateway/a.py": "from gateway import b\n",
        "gateway/b.py": "from .c import C\n",
        "gateway/c.py": "import gateway.a\n",
    })  # fmt: skip
    assert circles(import_graph(packages)) == [["gateway.a", "gateway.b", "gateway.c"]]
