"""Mooncake Store: what one put of a soak-sized record costs, ours against the bare client.

The soak's set-up (benchmarks/soak/stores.py: a throwaway ``mooncake_master``, a
``mooncake_client`` holding a 2 GB segment, a Redis for our index, TCP transport, free
loopback ports, everything stopped by pid).  Rounds of puts of a 4 MiB payload under fresh
keys, alternating in each round between ours (``MooncakeStore.put_parts``: the object plus
its index entry) and the bare client's ``put`` of the same bytes; per round the process's
CPU time per put of each and their ratio.  Nothing is deleted, so the 2 GB segment fills as
the rounds go (8 rounds of 2 x 30 puts: 1.9 GB): the soak's saturate figure on Mooncake
moves with Mooncake's own put cost, which the bare column shows.

    python benchmarks/bench_mooncake_put.py [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import markdown_table  # noqa: E402
from benchmarks.soak.stores import StoreUnderTest  # noqa: E402
from fd_routing_replay.store import open_store  # noqa: E402
from fdrr_dev.testing.mooncake import mooncake_master_binary  # noqa: E402

PAYLOAD = 4 << 20


def _cpu() -> float:
    return time.process_time()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 20 puts each")
    args = parser.parse_args()
    rounds, per_round = (3, 20) if args.quick else (8, 30)
    if mooncake_master_binary() is None:
        print("skipped: no mooncake_master binary (make deps installs Mooncake)")
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="fdrr-bench-mooncake-put-"))
    servers = StoreUnderTest("mooncake", workdir).start()
    try:
        store = open_store(servers.config("bench"), instrument=False)
        payload = np.random.default_rng(0).integers(0, 256, PAYLOAD, dtype=np.uint8).tobytes()
        rows = []
        for number in range(rounds):
            ours = bare = 0.0
            for i in range(per_round):      # alternate, so both see the same segment state
                started = _cpu()
                store.put_parts(f"bench_r{number}_{i}:0:0:0", [payload])
                middle = _cpu()
                code = store.client.put(f"bare/{number}/{i}", payload)
                ours, bare = ours + middle - started, bare + _cpu() - middle
                if code != 0:
                    raise RuntimeError(f"bare put failed with code {code}")
            rows.append([number, f"{(number + 1) * per_round * 2 * PAYLOAD / 2**20:.0f}",
                         f"{ours / per_round * 1e3:.2f} ms", f"{bare / per_round * 1e3:.2f} ms",
                         f"{ours / bare:.2f}x" if bare else "-"])
        store.close()
    finally:
        servers.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"### Mooncake put of a 4 MiB record, CPU time of this process per put "
          f"({rounds} rounds of {per_round} puts each, alternating)\n")
    print(markdown_table(["round", "MiB put so far", "ours (put_parts + index)", "bare put",
                          "ours / bare"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
