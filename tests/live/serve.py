"""Start the live rig by hand: ``make live-serve`` (``python -m tests.live.serve``).

A CPU test rig with fake CUDA, not a deployment: FastDeploy 2.6's OpenAI API server runs its
own Python on this machine's CPU with the tiny MoE model and the plugin; FastDeploy's compiled
kernels are CPU stand-ins (tests/fdcpu).  It prints the URL and the store to point
``fd-rr selftest`` at, and serves until Ctrl-C, then stops every process it started and
removes what FastDeploy left in /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from .rig import LiveServer, ServerOptions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.live.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the server's logs, model and store go (default: a new temporary directory)")
    parser.add_argument("--verify", action="store_true",
                        help="capture.verify: record the verification pattern fd-rr selftest checks")
    parser.add_argument("--no-plugin", action="store_true", help="FastDeploy's built-in routing replay instead")
    parser.add_argument("--no-overlap", action="store_true", help="--no-enable-overlap-schedule")
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fdrr-live-"))
    store = workdir / "store"
    rr_env = {"FD_RR_WRITER__CAPACITY_BYTES": "64MiB", "FD_RR_STORE__LOCAL__ROOT": str(store)}
    if args.verify:
        rr_env["FD_RR_CAPTURE__VERIFY"] = "true"
    options = ServerOptions(plugin=not args.no_plugin, overlap=not args.no_overlap, rr_env=rr_env,
                            routing={"enable_routing_replay": True, "local_store_dir": str(store)},
                            max_num_batched_tokens=args.max_num_batched_tokens, plants=False)
    server = LiveServer(workdir, options)
    print(f"starting FastDeploy on the CPU rig in {workdir} ...", flush=True)
    server.start()
    print(json.dumps({"url": server.base_url, "store": f"local://{store}", "namespace": "routing_replay",
                      "logs": str(server.log_dir)}, indent=1))
    selftest = (f"fd-rr selftest --url {server.base_url} --store local://{store} "
                "--shared-prefix-words 12 --long-prompt-words 40 --max-tokens 12")
    if args.verify:
        print(f"try: {selftest}\n(Ctrl-C stops the rig)", flush=True)
    else:
        print(f"serving (Ctrl-C stops the rig); the selftest needs --verify: {selftest}", flush=True)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):     # SIGINT too: a shell's background job starts with it ignored
        signal.signal(sig, lambda *a: stop.append(1))
    try:
        while not stop:
            server.check_alive()
            time.sleep(1.0)
    finally:
        server.stop()
        print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
