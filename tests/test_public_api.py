"""Public imports keep working: every name the package's modules list in ``__all__``, every
name the lazy facades (``fd_routing_replay``, ``fd_routing_replay.capture``) export, and every
entry point setup.cfg declares resolves."""

from __future__ import annotations

import ast
import configparser
import importlib
from pathlib import Path

import pytest

from tests.test_layering import package_modules

ROOT = Path(__file__).resolve().parents[1]


def _declared_all(path: Path) -> list[str] | None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return None  # computed (e.g. sorted(_EXPORTS)): checked through the module
    return None


#: Modules declaring ``__all__`` (statically or computed); ``__main__`` modules run on import.
MODULES = sorted(name for name, path in package_modules().items()
                 if not name.endswith(".__main__") and "__all__" in path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", MODULES)
def test_every_name_in_all_resolves(name):
    module = importlib.import_module(name)
    exported = module.__all__
    declared = _declared_all(package_modules()[name])
    if declared is not None:
        assert sorted(declared) == sorted(exported), name
    missing = [item for item in exported if not hasattr(module, item)]
    assert missing == [], f"{name}.__all__ names what it lacks: {missing}"
    assert len(set(exported)) == len(exported), f"{name}.__all__ lists a name twice"


def test_the_facade_exports_the_public_api():
    import fd_routing_replay

    assert {"RoutingRecord", "RoutingReader", "RoutingWriter", "open_store", "load_config",
            "RecordFormat", "__version__"} <= set(fd_routing_replay.__all__)
    for name in fd_routing_replay.__all__:
        assert getattr(fd_routing_replay, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nosuch'"):
        fd_routing_replay.nosuch  # noqa: B018


def test_every_entry_point_resolves():
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    section = parser["options.entry_points"]
    found = 0
    for group in section:
        for line in section[group].strip().splitlines():
            name, _, target = (part.strip() for part in line.partition("="))
            module, _, attribute = target.partition(":")
            resolved = getattr(importlib.import_module(module), attribute)
            assert callable(resolved), f"{group}: {name} = {target}"
            found += 1
    assert found >= 3  # fd-rr and FastDeploy's two plugin groups


def test_the_version_has_one_source():
    import fd_routing_replay
    from fd_routing_replay._version import __version__

    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    assert parser["metadata"]["version"] == "attr: fd_routing_replay._version.__version__"
    assert fd_routing_replay.__version__ == __version__
    assert parser["options"]["python_requires"] == ">=3.11"  # StrEnum, datetime.UTC
