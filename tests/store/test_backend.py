"""Stores as self-contained adapters: a backend is one module with a ``BACKEND``
declaration, and nothing central names it.

* a throwaway third-party backend (a module plus a ``.dist-info`` declaring the entry
  point, in a temp dir on ``sys.path``) gets its scheme opened by ``open_store``, its
  config section validated, env-overridable and in the generated config doc, its FastDeploy
  keys mapped and its doctor hooks run — with no file of this package edited;
* the central modules (config, registry, doctor, fsck, the doc generator) contain no
  backend name, branch, section access or import (checked on their syntax tree, so
  docstrings and comments may still mention them).
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fd_routing_replay.store.backend import Capability, StoreBackend, backend_named, backends

ROOT = Path(__file__).resolve().parents[2]
CENTRAL = ["fd_routing_replay/config/__init__.py", "fd_routing_replay/config/options.py",
           "fd_routing_replay/config/backends.py",
           "fd_routing_replay/store/registry.py", "fd_routing_replay/store/backend.py",
           "fd_routing_replay/store/__init__.py", "fd_routing_replay/store/indexed.py",
           "fd_routing_replay/cli/doctor.py", "fd_routing_replay/store/index/fsck.py",
           "scripts/gen_config_doc.py"]
CORE = {"local", "memory"}
#: Strings a central module may hold although they spell a backend name, and why.
ALLOWED = {
    # the name of doctor's check of the Redis a store depends on (a RedisTarget: the redis,
    # p2pstore and mooncake backends' data, metadata or index), shown in every report
    "fd_routing_replay/cli/doctor.py": frozenset({"redis"}),
    # the catalogue: the one list of the built-ins' light declaration modules
    "fd_routing_replay/config/backends.py": frozenset({"local", "memory", "mooncake", "p2pstore",
                                                       "redis"}),
}

# -- discovery --------------------------------------------------------------------------------


def test_built_ins_are_declared_in_light_modules_that_name_their_code():
    from fd_routing_replay.config.backends import BUILTIN_DECLARATIONS, LazyHook

    found = backends()
    assert {"local", "memory", "redis", "p2pstore", "mooncake"} <= set(found)
    for declaration in BUILTIN_DECLARATIONS:
        backend = sys.modules[declaration].BACKEND
        assert found[backend.name] is backend, declaration
        if backend.config_section is not None:  # the section is declared beside it
            assert backend.config_section.__module__ == declaration, backend.name
        # its code is named, not imported: a "module:function" in the backend's package
        assert isinstance(backend.factory, LazyHook), backend.name
        module, _, function = backend.factory.target.partition(":")
        assert module.startswith(f"fd_routing_replay.store.{backend.name}"), backend.factory
        assert backend.factory.resolve() is getattr(importlib.import_module(module), function)
    assert backend_named("rediss") is found["redis"]
    assert backend_named("file") is found["local"]
    assert backend_named("nosuch") is None


def test_declarations_are_checked():
    from fd_routing_replay.config.options import Section

    with pytest.raises(ValueError, match="not a valid backend name"):
        StoreBackend(name="no spaces", factory=print)
    with pytest.raises(ValueError, match="unknown capabilities"):
        StoreBackend(name="x", factory=print, capabilities=frozenset({"fast"}))
    with pytest.raises(ValueError, match="frozen dataclass"):
        StoreBackend(name="x", factory=print, config_section=dict)

    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Options(Section):
        depth: int = 1

    with pytest.raises(ValueError, match="store.<name>"):
        StoreBackend(name="options", factory=print, config_section=Options)
    with pytest.raises(ValueError, match="maps to 'width'"):
        StoreBackend(name="x", factory=print, config_section=Options,
                     fastdeploy_keys=(("x_width", "width"),))


# -- a third-party backend, end to end ------------------------------------------------------------

PLUGIN = '''
"""A throwaway store backend, declared like a third-party package would."""
import dataclasses
from typing import ClassVar

from fd_routing_replay.errors import ConfigError
from fd_routing_replay.store.backend import Capability, Section, StoreBackend, option
from fd_routing_replay.store.memory import MemoryStore

RAN = []


@dataclasses.dataclass(frozen=True)
class DemoConfig(Section):
    """Settings of the demo store."""

    depth: int = option(2, "How deep the demo store goes.", min=1, max=9)
    colour: str = option("red", "Colour of the demo store.", choices=("red", "blue"))


class DemoStore(MemoryStore):
    scheme = "demo"


def open_demo(store_config):
    return DemoStore(f"demo-{store_config.demo.depth}", store_config.namespace)


def open_legacy(store_config):
    return MemoryStore("legacy", store_config.namespace)


def validate(config):
    if config.store.demo.colour == "blue" and config.capture.fused is False:
        raise ConfigError("store.demo.colour 'blue' needs capture.fused: true")


def check_depth(store_config, timeout_s):
    from fd_routing_replay.core.diagnostics import OK, Check

    RAN.append(store_config.demo.depth)
    return Check("demo", OK, f"depth {store_config.demo.depth}")


def rdma_check(store_config, report):
    from fd_routing_replay.core.diagnostics import WARN, Check

    return Check("rdma", WARN, "demo uses carrier pigeons")


BACKEND = StoreBackend(
    name="demo", aliases=("demo+tls",), factory=open_demo, config_section=DemoConfig,
    capabilities=frozenset(), validate=validate,
    url_problem=lambda url: "must name a host" if url.startswith("demo:///") else None,
    fastdeploy_type="demo-fd", fastdeploy_keys=(("demo_depth", "depth"),),
    rdma_check=rdma_check,
    doctor_checks=(("demo", check_depth),))
'''

SCRIPT = '''
import json

from fd_routing_replay.config import config_from_fastdeploy, load_config, render_config_doc
from fd_routing_replay.cli.doctor import diagnose
from fd_routing_replay.errors import ConfigError
from fd_routing_replay.store import open_store
import rr_demo_backend

out = {}
config = load_config(overrides={"store": {"type": "demo"}}, env={"FD_RR_STORE__DEMO__DEPTH": "7"})
out["depth"] = config.store.demo.depth
store = open_store(config, instrument=False)
out["opened"] = [type(store).__name__, store.name]
out["by_url"] = open_store("demo+tls://x", instrument=False).name
out["legacy"] = open_store("legacy://x", instrument=False).name


def error(**kwargs):
    try:
        load_config(**kwargs)
    except ConfigError as exc:
        return str(exc)
    return None


out["too_deep"] = error(overrides={"store": {"demo": {"depth": 10}}}, env={})
out["bad_env"] = error(env={"FD_RR_STORE__DEMO__DEPTH": "deep"})
out["typo"] = error(overrides={"store": {"demo": {"dept": 3}}}, env={})
out["colour"] = error(overrides={"store": {"demo": {"colour": "green"}}}, env={})
out["validate"] = error(overrides={"store": {"type": "demo", "demo": {"colour": "blue"}},
                                   "capture": {"fused": False}}, env={})
out["url"] = error(overrides={"store": {"url": "demo:///nohost"}}, env={})
flat = load_config(overrides={"routing_store_type": "demo-fd", "demo_depth": 4}, env={})
out["fastdeploy"] = [flat.store.type, flat.store.demo.depth]
out["doc"] = [line for line in render_config_doc().splitlines() if "store.demo." in line]

report = diagnose(config.store)
out["doctor"] = {check.name: check.status for check in report.checks}
out["rdma"] = report.checks[1].summary
out["ran"] = rr_demo_backend.RAN
print("RESULT " + json.dumps(out))
'''


@pytest.fixture
def plugin_dir(tmp_path):
    (tmp_path / "rr_demo_backend.py").write_text(textwrap.dedent(PLUGIN))
    dist = tmp_path / "rr_demo_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rr-demo-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[fd_routing_replay.stores]\ndemo = rr_demo_backend:BACKEND\n"
        "legacy = rr_demo_backend:open_legacy\n")
    return tmp_path


def test_a_third_party_backend_plugs_in_everywhere(plugin_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(ROOT)]),
           "REPO": str(ROOT), "TMP": str(plugin_dir)}
    env = {k: v for k, v in env.items() if not k.startswith("FD_RR_STORE")}
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=plugin_dir, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out["depth"] == 7
    assert out["opened"] == ["DemoStore", "demo-7"]
    assert out["by_url"] == "demo-2" and out["legacy"] == "legacy"
    assert out["too_deep"] == "store.demo.depth: must be <= 9, got 10 (from overrides)"
    assert out["bad_env"].startswith("store.demo.depth: ") and \
        "environment variable FD_RR_STORE__DEMO__DEPTH" in out["bad_env"]
    assert "did you mean 'store.demo.depth'?" in out["typo"]
    assert out["colour"] == ("store.demo.colour: invalid value 'green'; allowed: 'red', 'blue' "
                             "(from overrides)")
    assert out["validate"] == "store.demo.colour 'blue' needs capture.fused: true"
    assert out["url"].startswith("store.url: must name a host")
    assert out["fastdeploy"] == ["demo", 4]
    assert out["doc"] == [
        "| `store.demo.depth` | int | `2` | `FD_RR_STORE__DEMO__DEPTH` | How deep the demo store goes. |",
        "| `store.demo.colour` | enum: red, blue | `\"red\"` | `FD_RR_STORE__DEMO__COLOUR` | Colour of the "
        "demo store. |"]
    assert out["doctor"] == {"config": "ok", "rdma": "warn", "redis": "skip", "demo": "ok",
                             "store": "ok", "roundtrip": "ok", "index": "skip"}
    assert out["rdma"] == "demo uses carrier pigeons" and out["ran"] == [7]
    # scripts/gen_config_doc.py, as it is, merges the section into docs/config.md
    copy = plugin_dir / "repo"
    (copy / "scripts").mkdir(parents=True)
    (copy / "docs").mkdir()
    for script in ("gen_config_doc.py", "generated_section.py"):
        (copy / "scripts" / script).write_text((ROOT / "scripts" / script).read_text())
    (copy / "docs" / "config.md").write_text((ROOT / "docs" / "config.md").read_text())
    generate = [sys.executable, str(copy / "scripts" / "gen_config_doc.py")]
    stale = subprocess.run([*generate, "--check"], env=env, capture_output=True, text=True)
    assert stale.returncode == 1, stale.stdout + stale.stderr
    assert subprocess.run(generate, env=env, capture_output=True).returncode == 0
    assert out["doc"][0] in (copy / "docs" / "config.md").read_text()


# -- nothing central names a backend ---------------------------------------------------------------


def _docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            found.add(id(node.value))  # module, class, function and attribute docstrings
    return found


def backend_mentions(source: str, names: set[str], modules: set[str],
                     allowed: frozenset[str] = frozenset()) -> list[str]:
    """Where ``source`` depends on particular backends: a string (outside docstrings, and
    not one of ``allowed``) with one of ``names`` as a word (``"mooncake"``,
    ``"store.p2pstore.device"``, ``"redis://h"``; not ``Redis`` the product), a name or a
    ``.name`` attribute spelled like one (a section access), or an import of a backend
    module or of a client library of the same name."""
    tree = ast.parse(source)
    docstrings = _docstring_nodes(tree)
    alternatives = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    word = re.compile(rf"(?<!\w)({alternatives})(?![\w-])")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings and node.value not in allowed \
                    and word.search(node.value):
                found.append(f"line {node.lineno}: string {node.value[:60]!r}")
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"line {node.lineno}: attribute .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in names:
            found.append(f"line {node.lineno}: name {node.id}")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            imported = [alias.name for alias in node.names]
            if isinstance(node, ast.ImportFrom):
                imported = [node.module or ""] + [f"{node.module}.{name}" for name in imported]
            found += [f"line {node.lineno}: imports {module}" for module in imported
                      if module in modules or module.split(".")[0] in names]
    return found


def _non_core():
    names, modules = set(), set()
    for backend in backends().values():
        if backend.name in CORE:
            continue
        names |= {name.lower() for name in backend.names}
        modules.add(backend.factory.target.partition(":")[0])  # its code, named by the catalogue
    return names, modules


def test_the_check_finds_what_it_looks_for():
    names, modules = _non_core()
    planted = textwrap.dedent('''
        """Docstrings may say mooncake and redis."""
        from fd_routing_replay.store.mooncake import mooncake_settings
        from fd_routing_replay.store import p2pstore
        import redis
        _INDEXED = ("redis", "p2pstore")
        def f(store_type, store_config):
            # a comment about p2pstore
            if store_type == "mooncake":
                return store_config.redis.url
            return redis_client(f"cannot open p2pstore {store_type}")
    ''')
    found = backend_mentions(planted, names, modules)
    assert len(found) == 8, found
    assert not any("Docstrings" in item or "comment" in item for item in found)


@pytest.mark.parametrize("path", CENTRAL)
def test_central_modules_name_no_backend(path):
    names, modules = _non_core()
    assert {"redis", "p2pstore", "mooncake"} <= names
    found = backend_mentions((ROOT / path).read_text(encoding="utf-8"), names, modules,
                             ALLOWED.get(path, frozenset()))
    assert found == [], f"{path} depends on particular backends: {found}"


# -- capabilities -----------------------------------------------------------------------------------


def test_indexed_backends_are_the_ones_doctor_and_fsck_check():
    indexed = {name for name, backend in backends().items() if backend.has(Capability.INDEXED)}
    assert indexed >= {"redis", "p2pstore", "mooncake"}
    assert not indexed & {"local", "memory"}
    with_redis = {name for name, backend in backends().items() if backend.redis_target}
    assert indexed <= with_redis  # an index lives in Redis: doctor pings it
