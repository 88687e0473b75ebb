"""docs/trainer.md's PaddleFormers examples run as written, after the page's first example
(which stores the records they read), in this environment (.venv-paddle).  The prelude is
the PaddleFleet availability probe the page says a machine without PaddleFleet needs."""

from __future__ import annotations

import pytest

pytest.importorskip("paddleformers", reason="PaddleFormers runs in its own environment: "
                    "`make trainer-paddle` (.venv-paddle)")

from tests.trainers.test_trainer_doc import PADDLE_SECTION, doc_blocks, run_script  # noqa: E402

PRELUDE = """\
from tests.trainers.paddle.standins import install_paddlefleet_probe
install_paddlefleet_probe()
"""


def test_paddle_examples_run(tmp_path):
    blocks = doc_blocks()
    paddle = [code for heading, code in blocks if heading == PADDLE_SECTION]
    assert paddle, f"docs/trainer.md has no example under '## {PADDLE_SECTION}'"
    setup = blocks[0][1]
    assert "store.put" in setup, "the page's first example stores the records"
    done = run_script(PRELUDE + "\n".join([setup, *paddle]), tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("examples finished")
