"""Start N ranks of a script with Paddle's launcher on loopback, bounded in time, and
leave nothing running.

``python -m paddle.distributed.launch`` gives every rank its own session (``os.setsid``,
paddle/distributed/launch/utils/process_context.py), so killing the launcher's process
group does not reach them.  Every process of one run therefore carries a run token in its
environment; when the run ends -- success, failure or timeout -- each process still
carrying the token is killed by its pid.  A failed or timed-out run raises
:class:`RanksFailed` with every rank's log, so a test fails with the logs and never hangs.

The ranks talk over ``127.0.0.1``: ``--ips 127.0.0.1 --start_port P`` makes the launcher
use the endpoints ``127.0.0.1:P+i`` (rank ``i``) and rank 0's endpoint as the rendezvous
master, with ``P`` a block of free loopback ports found here.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fdrr_dev.testing.process import read_log_tail

__all__ = ["RANK_TOKEN_ENV", "RankRun", "RanksFailed", "free_port_block", "launch_ranks",
           "processes_with_token"]

RANK_TOKEN_ENV = "FDRR_TEST_RANKS_TOKEN"   # not FD_RR_*: the plugin refuses unknown FD_RR_ names
"""The environment variable carrying a run's token (inherited by every rank)."""

LOG_LINES = 80

_FAILED_CONTAINER = re.compile(r"Container rank (\d+) status failed .*? code (-?\d+)")
"""How Paddle's launcher logs a failed rank (``Container.__str__``, launch/job/container.py:174,
logged for the first failed rank only by launch/controllers/controller.py:123; Paddle 3.3.1)."""


@dataclass
class RankRun:
    """A finished run: its exit status, where its logs are, and each rank's log text."""

    returncode: int
    log_dir: Path
    nproc: int
    token: str = ""          # every process of the run carries it (see processes_with_token)

    def rank_log(self, rank: int) -> str:
        path = self.log_dir / f"workerlog.{rank}"
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def failed_ranks(self) -> dict[int, int]:
        """Rank -> exit code of each rank the launcher reported as failed (its own log)."""
        try:
            text = (self.log_dir / "launcher.log").read_text(errors="replace")
        except OSError:
            return {}
        return {int(m.group(1)): int(m.group(2)) for m in _FAILED_CONTAINER.finditer(text)}

    def summary(self) -> str:
        """One line per rank: the launcher's verdict on it and the last line of its log.

        Leads a failure's message, so a truncated CI log still says which rank failed and
        why (a rank's traceback can otherwise sit in the middle of several log tails)."""
        failed = self.failed_ranks()
        out = []
        for rank in range(self.nproc):
            last = next((line.strip() for line in reversed(self.rank_log(rank).splitlines())
                         if line.strip()), "(empty log)")
            verdict = f"failed, exit code {failed[rank]}" if rank in failed else "not reported failed"
            out.append(f"rank {rank} ({verdict}): {last[:300]}")
        return "\n".join(out)

    def logs(self, lines: int = LOG_LINES) -> str:
        """Every rank's log tail, then the launcher's."""
        parts = [read_log_tail(self.log_dir / f"workerlog.{rank}", f"rank {rank}", lines)
                 or f"--- rank {rank}: no log ---" for rank in range(self.nproc)]
        parts.append(read_log_tail(self.log_dir / "launcher.log", "launcher", lines))
        return "\n".join(parts)


class RanksFailed(AssertionError):
    """A multi-rank run exited non-zero or ran past its time limit; the message has every
    rank's log tail, ``run`` the run (its logs, its token)."""

    def __init__(self, message: str, run: RankRun) -> None:
        super().__init__(message)
        self.run = run


def _block_is_free(host: str, start: int, count: int) -> bool:
    for port in range(start, start + count):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports free on ``host`` right now."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            start = sock.getsockname()[1]
        if start + count <= 65535 and _block_is_free(host, start, count):
            return start
    raise RuntimeError(f"no block of {count} free ports found on {host}")


def processes_with_token(token: str) -> list[int]:
    """Pids of this user's processes whose environment carries ``token`` (Linux /proc)."""
    needle = f"{RANK_TOKEN_ENV}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:          # gone, or not ours
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _kill_run(launcher: subprocess.Popen, token: str) -> None:
    """SIGKILL the launcher and every process that carries the run's token, by pid."""
    if launcher.poll() is None:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)     # the launcher's own session
        except ProcessLookupError:
            pass
    for _ in range(5):
        pids = processes_with_token(token)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:            # reap what is ours; others are reaped by init
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    try:
        launcher.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def launch_ranks(script: str | os.PathLike[str], nproc: int, *, log_dir: str | os.PathLike[str],
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 timeout_s: float = 120.0, python: str | None = None,
                 cwd: str | os.PathLike[str] | None = None) -> RankRun:
    """Run ``script`` on ``nproc`` ranks (``paddle.distributed.launch``) and wait for them.

    Raises :class:`RanksFailed` with every rank's log when the run exits non-zero or is
    still running after ``timeout_s``; either way nothing of the run is left running.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    run_env = dict(os.environ if env is None else env)
    run_env[RANK_TOKEN_ENV] = token
    start_port = free_port_block(nproc)
    command = [python or sys.executable, "-m", "paddle.distributed.launch",
               "--ips", "127.0.0.1", "--host", "127.0.0.1", "--start_port", str(start_port),
               "--nproc_per_node", str(nproc), "--max_restart", "0", "--log_dir", str(log_dir),
               str(script), *args]
    run = RankRun(returncode=-1, log_dir=log_dir, nproc=nproc, token=token)
    with open(log_dir / "launcher.log", "wb") as launcher_log:
        launcher = subprocess.Popen(command, env=run_env, cwd=cwd, stdout=launcher_log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        try:
            run.returncode = launcher.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_run(launcher, token)
            raise RanksFailed(f"{nproc} ranks of {script} still running after {timeout_s:.0f} s; "
                              f"killed\n{run.summary()}\n{run.logs()}", run) from None
        finally:
            _kill_run(launcher, token)
    if run.returncode != 0:
        raise RanksFailed(f"{nproc} ranks of {script} failed (launcher exit {run.returncode})\n"
                          f"{run.summary()}\n{run.logs()}", run)
    return run
