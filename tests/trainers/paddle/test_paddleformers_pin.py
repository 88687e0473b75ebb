"""The PaddleFormers release the Paddle adapter was read against, and its seams' signatures:
a new release fails here first, naming what to re-read (families.py)."""

from __future__ import annotations

import importlib
import inspect

import pytest

pytest.importorskip("paddleformers", reason="PaddleFormers runs in its own environment: "
                    "`make trainer-paddle` (.venv-paddle)")

import paddleformers  # noqa: E402

import tests.trainers.paddle.models  # noqa: E402, F401  (the PaddleFleet probe stand-in)
from fd_routing_replay.trainers.paddle import PADDLE_FAMILIES, TESTED_PADDLEFORMERS  # noqa: E402


def test_the_installed_paddleformers_is_the_tested_one():
    assert paddleformers.__version__ == TESTED_PADDLEFORMERS, \
        "tests/trainers/paddle/requirements.txt pins PaddleFormers: update TESTED_PADDLEFORMERS"


@pytest.mark.parametrize("family", PADDLE_FAMILIES, ids=lambda f: f.name)
def test_seam_signatures_are_the_recorded_ones(family):
    assert family.signatures
    for qualified, recorded in family.signatures:
        module, cls, method = qualified.rsplit(".", 2)
        live = str(inspect.signature(getattr(getattr(importlib.import_module(module), cls),
                                             method)))
        assert live == recorded, (f"{family.name}: {cls}.{method} is now {live}, the replay "
                                  f"was written for {recorded}: re-read the gate and update "
                                  "families.py")
