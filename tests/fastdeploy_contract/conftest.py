"""The FastDeploy contract tier: FastDeploy's own Python code, run around the plugin.

Which FastDeploy: an installed ``fastdeploy`` when present, else ``FD_SOURCE_DIR``, else
``../shared/fastdeploy/$FD_CONTRACT_VERSION``.  ``make contract`` runs this directory once
per version (2.5, develop-2026-04, 2.6) in its own environment (``.venv-fd``), since one
process can import only one ``fastdeploy``.  Under ``CI=true`` missing sources or a broken
environment fail the run instead of skipping it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared" / "fastdeploy"
VERSION = os.environ.get("FD_CONTRACT_VERSION", "2.6")
IN_CI = os.environ.get("CI", "").lower() == "true"


def _locate() -> tuple[str | None, str]:
    """(source directory to put on sys.path or None for an installed one, description)."""
    if importlib.util.find_spec("fastdeploy") is not None:
        return None, "installed fastdeploy"
    explicit = os.environ.get("FD_SOURCE_DIR")
    if explicit:
        return explicit, f"FD_SOURCE_DIR={explicit}"
    return str(SHARED / VERSION), f"../shared/fastdeploy/{VERSION}"


SOURCE, SOURCE_TEXT = _locate()
PROBLEM: str | None = None
if SOURCE is not None and not (Path(SOURCE) / "fastdeploy" / "__init__.py").exists():
    PROBLEM = f"FastDeploy sources not found at {SOURCE_TEXT} ({SOURCE})"
else:
    sys.path.insert(0, str(HERE))
    from fdrr_dev.testing import fastdeploy_standins as standins  # noqa: E402

    STANDINS = standins.install()
    if SOURCE is not None:
        sys.path.insert(0, SOURCE)
    os.environ.setdefault("FD_PLUGINS", "fd_routing_replay")
    # FastDeploy's loggers write under $FD_LOG_DIR (default ./log); keep them out of the tree.
    import tempfile

    os.environ.setdefault("FD_LOG_DIR", tempfile.mkdtemp(prefix="fd-contract-log-"))
    try:
        import fastdeploy.config  # noqa: F401
        import fastdeploy.worker.gpu_worker  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means the tier cannot run
        PROBLEM = f"FastDeploy from {SOURCE_TEXT} does not import here: {exc!r}"


def pytest_collection_modifyitems(config, items):
    if PROBLEM is None:
        return
    if IN_CI:
        raise pytest.UsageError(f"FastDeploy contract tier cannot run under CI=true: {PROBLEM}")
    skip = pytest.mark.skip(reason=PROBLEM)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


def pytest_report_header(config):
    return f"FastDeploy contract tier: {SOURCE_TEXT} (version label {VERSION}); problem: {PROBLEM}"


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A working directory for one FastDeploy instance: our plugin, a thread-mode writer,
    FastDeploy's loggers under ./log."""
    monkeypatch.setenv("FD_PLUGINS", "fd_routing_replay")
    monkeypatch.setenv("FD_RR_WRITER__MODE", "thread")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "log").mkdir()
    return tmp_path
