"""The package's structure, guarded: imports run one way, bottom-up through the floors of
docs/architecture.md, no module tops 500 lines, no private name crosses a module boundary,
benchmarks never import the test suite and the runtime never imports the development
package (``fdrr_dev``: the harness and the test servers, which the wheel does not carry).

Every import counts, lazy ones inside functions included; only ``if TYPE_CHECKING:``
blocks are left out (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "fd_routing_replay"
MAX_LINES = 600

#: Bottom-up; a module may import its own floor or a lower one, never a higher one.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "keys", "_version", "core", "rdma"),
    ("codec", "metrics"),
    ("ops", "config"),
    ("store",),
    ("writer", "reader", "trainers"),
    ("capture",),
    ("integrations",),
    ("cli",),
)
FLOOR_OF = {part: level for level, parts in enumerate(FLOORS) for part in parts}

#: Known exceptions, each to be deleted when fixed (a stale entry fails the test too).
#: Cycles by their sorted members, upward arrows as "importer -> imported", big modules and
#: private imports by module name.
KNOWN_CYCLES: set[tuple[str, ...]] = set()
KNOWN_UPWARD: set[str] = set()
KNOWN_BIG: set[str] = set()
KNOWN_PRIVATE: set[str] = set()


# -- reading the imports ------------------------------------------------------------------------

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package (the ops build directory and shipped sources left out)."""
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        relative = path.relative_to(ROOT / PACKAGE).parts
        if relative[0] in ("_ops", "_csrc"):
            continue
        found[module_name(path)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def raw_imports(path: Path, name: str) -> list[tuple[int, str, str | None]]:
    """``(line, module, imported name or None)`` for every import that can run."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str, str | None]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.extend((node.lineno, module, alias.name) for alias in node.names)
        else:
            visit(node)

    visit(tree)
    return found


def edges(modules: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """The import graph between package modules, and every private cross-module import."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    private = []
    for name, path in modules.items():
        for line, module, imported in raw_imports(path, name):
            if imported and f"{module}.{imported}" in modules:
                target, imported = f"{module}.{imported}", None
            elif module in modules:
                target = module
            else:
                continue
            if target != name:
                graph[name].add(target)
                if imported and imported.startswith("_") and not imported.startswith("__"):
                    private.append(f"{name}:{line} imports {target}.{imported}")
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
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
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                    found.append(tuple(sorted(component)))
    return sorted(found)


def floor(module: str) -> int | None:
    """The floor of a package module (None for the package root, a lazy facade)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if parts[1] not in FLOOR_OF:
        raise AssertionError(f"{module}: {parts[1]!r} sits on no floor; add it to FLOORS "
                             "(and docs/architecture.md)")
    return FLOOR_OF[parts[1]]


def upward(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for importer, targets in graph.items():
        for target in targets:
            low, high = floor(importer), floor(target)
            if target == PACKAGE and importer != PACKAGE:
                found.append(f"{importer} -> {target}")  # the facade imports everything
            elif low is not None and high is not None and high > low:
                found.append(f"{importer} -> {target}")
    return sorted(found)


@pytest.fixture(scope="module")
def structure():
    modules = package_modules()
    graph, private = edges(modules)
    return modules, graph, private


def _check(found: set, known: set, what: str) -> None:
    new, fixed = sorted(found - known), sorted(known - found)
    assert not new, f"new {what}: {new}"
    assert not fixed, f"fixed {what} still listed as known exceptions (delete them): {fixed}"


# -- the checks ---------------------------------------------------------------------------------

def test_no_import_cycle(structure):
    _, graph, _ = structure
    _check(set(cycles(graph)), KNOWN_CYCLES, "import cycles")


def test_imports_run_down_the_floors(structure):
    _, graph, _ = structure
    _check(set(upward(graph)), KNOWN_UPWARD, "upward imports")


def test_no_module_over_500_lines(structure):
    modules, _, _ = structure
    big = {name for name, path in modules.items()
           if len(path.read_text(encoding="utf-8").splitlines()) > MAX_LINES}
    _check(big, KNOWN_BIG, f"modules over {MAX_LINES} lines")


def test_no_private_name_crosses_a_module(structure):
    _, _, private = structure
    _check({item.split(":")[0] for item in private}, KNOWN_PRIVATE,
           f"private cross-module imports ({private})")


def test_the_checks_see_what_they_look_for(tmp_path, monkeypatch):
    """Each check fails on a planted case: a lazy cycle, an upward arrow, a private import;
    a TYPE_CHECKING import is ignored."""
    package = tmp_path / PACKAGE
    (package / "core").mkdir(parents=True)
    (package / "store").mkdir()
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("")
    (package / "store" / "__init__.py").write_text("")
    (package / "core" / "a.py").write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from fd_routing_replay.store import ignored
        def f():
            from fd_routing_replay.store.b import thing
    """))
    (package / "store" / "b.py").write_text("from fd_routing_replay.core.a import _secret\n")
    (package / "store" / "ignored.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    modules = package_modules()
    graph, private = edges(modules)
    assert cycles(graph) == [("fd_routing_replay.core.a", "fd_routing_replay.store.b")]
    assert upward(graph) == ["fd_routing_replay.core.a -> fd_routing_replay.store.b"]
    assert private == ["fd_routing_replay.store.b:1 imports fd_routing_replay.core.a._secret"]
    assert "fd_routing_replay.store.ignored" not in graph["fd_routing_replay.core.a"]


def test_every_module_sits_on_a_floor(structure):
    modules, _, _ = structure
    for name in modules:
        floor(name)  # raises for a top-level name missing from FLOORS


# -- what loads what ----------------------------------------------------------------------------

def _loaded_after(statement: str) -> list[str]:
    script = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=True)
    return [line for line in result.stdout.splitlines() if line.startswith(PACKAGE)]


def test_loading_the_config_loads_no_backend_writer_or_capture():
    loaded = _loaded_after("from fd_routing_replay.config import load_config; load_config(env={})")
    heavy = [name for name in loaded
             if name.startswith((f"{PACKAGE}.store", f"{PACKAGE}.writer", f"{PACKAGE}.capture",
                                 f"{PACKAGE}.reader", f"{PACKAGE}.integrations"))]
    assert heavy == [], heavy
    assert f"{PACKAGE}.config.stores.redis" in loaded  # the light declarations do load


def test_a_backend_module_loads_only_when_chosen():
    loaded = _loaded_after("from fd_routing_replay.store import open_store\n"
                           "open_store('memory://layering').close()")
    assert f"{PACKAGE}.store.memory" in loaded
    others = [name for name in loaded
              if name.startswith(tuple(f"{PACKAGE}.store.{b}" for b in
                                       ("local", "redis", "p2pstore", "mooncake", "index")))]
    assert others == [], others


# -- the test suite and the testing helpers ------------------------------------------------------

def offending(files: list[Path], package: str) -> list[str]:
    found = []
    for path in files:
        name = module_name(path) if PACKAGE in path.parts else path.stem
        for line, module, imported in raw_imports(path, name):
            target = f"{module}.{imported}" if imported else module
            if module == package or module.startswith(package + ".") or target == package:
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    return found


def test_no_benchmark_imports_the_test_suite():
    files = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert files, "no benchmark found"
    assert offending(files, "tests") == [], \
        "benchmarks must use fdrr_dev.testing, not tests/"


def test_runtime_package_never_imports_the_development_package():
    files = list(package_modules().values())
    assert offending(files, "fdrr_dev") == []


def test_the_architecture_tree_is_current():
    """docs/architecture.md's tree is generated from the modules' docstrings."""
    result = subprocess.run([sys.executable, "scripts/gen_architecture_tree.py", "--check"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
