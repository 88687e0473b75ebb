"""The live tier: FastDeploy 2.6's real OpenAI API server on a CPU (``make live``).

Each test module declares ``OPTIONS`` (a :class:`~tests.live.rig.ServerOptions`) and gets
one server for its tests (``server``); a failed test's report carries every rig process's
log tail, and the module fails if stopping the server left a process, a /dev/shm entry or
a message queue behind.  Runs only with ``FDRR_LIVE_TIER=1`` in the contract tier's
environment plus ``.live-deps`` (see the Makefile); under ``CI=true`` a missing piece fails
the run instead of skipping it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from .checks import Context
from .rig import FD_SOURCE, LiveServer

HERE = Path(__file__).resolve().parent
IN_CI = os.environ.get("CI", "").lower() == "true"


def _problem() -> str | None:
    for module in ("fastdeploy", "gunicorn", "openai", "paddle"):
        if module == "fastdeploy":
            if not (FD_SOURCE / "fastdeploy" / "__init__.py").exists():
                return f"FastDeploy 2.6 sources not found at {FD_SOURCE} (FD_SOURCE_DIR)"
        elif importlib.util.find_spec(module) is None:
            return f"{module} is not importable (run `make live-env`: the live tier needs .venv-fd and .live-deps)"
    return None


PROBLEM = _problem()


def pytest_collection_modifyitems(config, items):
    if PROBLEM is None:
        return
    if IN_CI:
        raise pytest.UsageError(f"the live tier cannot run under CI=true: {PROBLEM}")
    skip = pytest.mark.skip(reason=PROBLEM)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def redis_url():
    """A throwaway redis-server on a loopback port (for the Redis store scenarios)."""
    from fdrr_dev.testing.redis import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        if IN_CI:
            pytest.fail("redis-server is not installed (make deps installs it)")
        pytest.skip("redis-server is not installed")
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """One FastDeploy server for the module, built from its ``OPTIONS`` (or
    ``make_options(request)`` when the options need other fixtures)."""
    make = getattr(request.module, "make_options", None)
    options = make(request) if make is not None else request.module.OPTIONS
    live = LiveServer(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]), options)
    live.start()
    yield live
    live.plant(None)
    live.stop()
    left = live.processes()
    assert not left, f"processes of the rig still running after stop: {left}"
    assert not live.shm_entries(), f"/dev/shm entries left behind: {live.shm_entries()}"


@pytest.fixture(scope="module")
def ctx(server):
    """The server with its store's reader and the independent recompute."""
    return Context(server)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    live = item.funcargs.get("server") if hasattr(item, "funcargs") else None
    if live is None and hasattr(item, "funcargs") and "ctx" in item.funcargs:
        live = item.funcargs["ctx"].server
    if report.failed and isinstance(live, LiveServer):
        report.sections.append(("live server log tails", live.log_tails(40)))
