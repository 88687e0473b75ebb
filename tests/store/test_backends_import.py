"""Every store backend a user can name imports, also without its optional extra.

A backend module whose import breaks (a renamed helper, an optional dependency imported at
module level) would otherwise surface only when an operator first selects it — or, since
the config is built from the backends' declarations, break every config load.
"""

from __future__ import annotations

import configparser
import subprocess
import sys
import textwrap
from pathlib import Path

from fd_routing_replay.store import registry
from fd_routing_replay.store.backend import backends

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("redis", "mooncake", "p2pstore", "pyverbs", "paddle", "torch")


def test_every_known_store_type_resolves_to_a_callable_factory():
    names = registry.known_store_types()
    assert {"memory", "local", "redis", "p2pstore", "mooncake"} <= set(names)
    for name in names:
        assert callable(registry.resolve_factory(name)), name


def test_built_ins_are_not_listed_as_entry_points():
    """Built-ins are found by their declaration; listing them in setup.cfg too would be a
    second place to edit when adding one."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    listed = parser["options.entry_points"].get(registry.ENTRY_POINT_GROUP, "")
    assert not listed.strip(), f"setup.cfg lists store backends: {listed.strip()}"


def test_store_modules_and_the_config_import_without_the_optional_extras():
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, pkgutil, sys

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {OPTIONAL!r}:
                    raise ImportError(f"{{name}} is not installed (refused by the test)")

        sys.meta_path.insert(0, Refuse())
        import fd_routing_replay.store as package
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module("fd_routing_replay.store." + info.name)
        from fd_routing_replay.config import load_config
        from fd_routing_replay.store.backend import backends
        config = load_config(env={{}})
        print(sorted(backends()), config.store.mooncake.max_batch)
        loaded = sorted(name for name in sys.modules if name.split(".")[0] in {OPTIONAL!r})
        assert not loaded, loaded
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("]")[0] + "]" == str(sorted(backends()))
