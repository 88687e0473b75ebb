"""Small helpers shared by the benchmark scripts: timing and markdown tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def median_seconds(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (``setup`` runs untimed before each)."""
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def fmt_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# Rollout keys of the prefix-delete benchmarks: {experiment}:{data}:{gen}:{turn}:{segment}.
GENS, TURNS, SEGS = 5, 2, 2


def keys_for(n: int) -> tuple[list[str], list[str]]:
    """(keys, prefixes): n keys, n/4 prefixes of 4 keys each, prefixes in a stable
    shuffled order."""
    import random

    datas = max(1, n // (GENS * TURNS * SEGS))
    prefixes = [f"exp_epoch_3:{d}:{g}" for d in range(datas) for g in range(GENS)]
    keys = [f"{p}:{t}:{s}" for p in prefixes for t in range(TURNS) for s in range(SEGS)]
    random.Random(1234).shuffle(prefixes)
    return keys, prefixes
