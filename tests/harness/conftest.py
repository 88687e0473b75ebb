"""Fixtures of the harness tests: a capturing run checked against a teacher-forced forward."""

from __future__ import annotations

import uuid

import pytest

from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store
from fdrr_dev.harness.engine import EngineConfig
from fdrr_dev.harness.fidelity import check_results
from fdrr_dev.harness.session import run_rollouts

FINISHED = ("eos", "length")


def memory_url(prefix="harness"):
    return f"memory://{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def run_checked(make_writer):
    def run_checked(plan, engine_config=None, *, only_last_turn=False, expect=None, **kwargs):
        return checked_run(make_writer, plan, engine_config, only_last_turn=only_last_turn, expect=expect,
                           **kwargs)
    return run_checked


def checked_run(make_writer, plan, engine_config=None, *, only_last_turn=False, expect=None, **kwargs):
    engine_config = engine_config or EngineConfig()
    url = memory_url()
    store = open_store(url)
    run = run_rollouts(plan, engine_config=engine_config,
                       writer=make_writer(url, only_last_turn=only_last_turn), **kwargs)
    reader = RoutingReader(store)
    expect = expect or (lambda r: r.finish_reason in FINISHED)
    report = check_results(run.results, reader.get, run.model_for_version, expect_present=expect)
    return run, report, store


