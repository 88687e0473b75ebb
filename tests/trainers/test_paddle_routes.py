"""The Paddle adapter's NumPy side, in the main environment (no PaddleFormers needed): its
imports stay lazy and a sequence-parallel rank's share is the tokens its gate sees.
tests/trainers/paddle runs the replay itself on PaddleFormers' models (.venv-paddle)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from fd_routing_replay.trainers.hf.routes import padded_routes
from fd_routing_replay.trainers.paddle import (
    PADDLE_FAMILIES,
    paddle_family_of,
    sequence_parallel_routes,
)
from tests.trainers.records import make_record


def test_importing_the_adapter_imports_no_paddle():
    code = ("import sys, fd_routing_replay.trainers, fd_routing_replay.trainers.paddle; "
            "print(sorted(m for m in ('paddle', 'paddleformers', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("order", ["bs", "sb"])
def test_a_ranks_share_is_its_contiguous_slice_of_the_flattened_batch(seed, order):
    """Reference: lay the batch out ``[B, S]``, flatten it in the model's order, cut it in
    ``sp`` equal contiguous shares."""
    gen = np.random.default_rng(seed)
    batch_size, width, sp = 3, 8, 4
    records = [make_record(gen, f"exp_p:{i}:0", tokens=n - 1, layers=(1, 3))
               for i, n in enumerate([8, 5, 7])]
    mask = np.zeros((batch_size, width), dtype=int)
    mask[0], mask[1, 3:], mask[2, :7] = 1, 1, 1
    whole = padded_routes(records, mask)
    grid = whole.ids.reshape(2, batch_size, width, 2)
    valid = whole.valid.reshape(2, batch_size, width)
    if order == "sb":
        grid, valid = grid.transpose(0, 2, 1, 3), valid.transpose(0, 2, 1)
    flat, flat_valid = grid.reshape(2, -1, 2), valid.reshape(2, -1)
    share = batch_size * width // sp
    for rank in range(sp):
        mine = sequence_parallel_routes(whole, sp, rank, batch_size=batch_size, order=order)
        cut = slice(rank * share, (rank + 1) * share)
        assert mine.layers == (1, 3) and mine.num_experts == 8
        assert (mine.ids == flat[:, cut]).all() and (mine.valid == flat_valid[:, cut]).all()
    with pytest.raises(ValueError, match="not divisible by tensor parallel size 5"):
        sequence_parallel_routes(whole, 5, 0, batch_size=batch_size)
    with pytest.raises(ValueError, match="do not split into batch_size 5"):
        sequence_parallel_routes(whole, 2, 0, batch_size=5, order="sb")
    with pytest.raises(ValueError, match="order must be one of"):
        sequence_parallel_routes(whole, 2, 0, order="bsh")


def test_families_are_found_by_qualified_class_name():
    """A class named like a PaddleFormers gate elsewhere is not one (PaddleFormers' own
    classes are matched in tests/trainers/paddle)."""
    assert {f.name for f in PADDLE_FAMILIES} == {"DeepSeek-V3", "DeepSeek-V3 (expert parallel)",
                                                 "ERNIE-4.5-MoE"}
    impostor = type("DeepseekV3TopkRouter", (), {})
    assert paddle_family_of(impostor()) is None
