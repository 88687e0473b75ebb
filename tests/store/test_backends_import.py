"""Every store backend a user can name imports: the built-ins and the declared entry points.

A backend module whose import breaks (a renamed helper, an optional dependency imported at
module level) would otherwise surface only when an operator first selects it.
"""

from __future__ import annotations

import configparser
from importlib.metadata import entry_points
from pathlib import Path

from fd_routing_replay.store import registry

ROOT = Path(__file__).resolve().parents[2]


def declared_entry_points() -> dict[str, str]:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    lines = parser["options.entry_points"][registry.ENTRY_POINT_GROUP].strip().splitlines()
    return dict((part.strip() for part in line.split("=", 1)) for line in lines)


def test_every_known_store_type_resolves_to_a_callable_factory():
    names = registry.known_store_types()
    assert {"memory", "local", "redis", "p2pstore"} <= set(names)
    for name in names:
        assert callable(registry.resolve_factory(name)), name


def test_every_declared_entry_point_is_installed_and_loads():
    declared = declared_entry_points()
    installed = {ep.name: ep for ep in entry_points(group=registry.ENTRY_POINT_GROUP)}
    assert set(declared) <= set(installed), "reinstall the package: setup.cfg declares more backends"
    for name, target in declared.items():
        assert installed[name].value == target
        assert callable(installed[name].load()), name
