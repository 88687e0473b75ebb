"""Import layering: benchmarks never import the test suite, and the runtime package never
imports its testing helpers (``fd_routing_replay.testing``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import statement in ``path`` (relative ones resolved
    against nothing: they stay relative, e.g. ``.servers``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found.append((node.lineno, module))
    return sorted(found)


def offending(files: list[Path], package: str) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: imports {module}"
            for path in files for line, module in imported_modules(path)
            if module == package or module.startswith(package + ".")]


def test_the_check_sees_every_import_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import tests.servers\nfrom tests import x\n"
                      "def f():\n    from tests.store import y\nimport testsuite\n")
    assert [module for _, module in imported_modules(sample)] == \
        ["tests.servers", "tests", "tests.store", "testsuite"]
    found = [m for _, m in imported_modules(sample) if m == "tests" or m.startswith("tests.")]
    assert len(found) == 3


def test_no_benchmark_imports_the_test_suite():
    files = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert files, "no benchmark found"
    assert offending(files, "tests") == [], \
        "benchmarks must use fd_routing_replay.testing, not tests/"


def test_runtime_package_never_imports_its_testing_helpers():
    package = ROOT / "fd_routing_replay"
    files = [path for path in sorted(package.rglob("*.py"))
             if (package / "testing") not in path.parents]
    assert offending(files, "fd_routing_replay.testing") == []
