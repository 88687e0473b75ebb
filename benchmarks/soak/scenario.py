"""One soak scenario: a store's servers, producers, trainers, the deleting driver, a fault;
then the accounting of every record.

:class:`ScenarioRun` starts the store (:mod:`.stores`), M trainers and N producers (each
in its own process group), and then, until the producers have submitted for
``duration_s`` and closed their writers:

* reads every process's events (:mod:`.events`);
* as the **driver**, deletes each training step by prefix once every producer has moved
  past it and every rollout's last accepted turn of it has been read (or
  ``step_timeout_s`` after that, read or not), on a store of its own (a thread, so a slow
  delete never stalls the rest), timing each delete and, on Redis, every command the
  server ran meanwhile (``SLOWLOG`` with a 0 µs threshold, reset before each delete);
* keeps producers at most ``max_steps_ahead`` steps ahead of the last deleted step (the
  ``step-gate`` file), as an RL driver bounds how far rollouts run ahead of training, so
  what is in flight stays bounded whatever the trainers' pace;
* samples every process's resident memory (``/proc/PID/status``) twice a second;
* fires the fault (:mod:`.faults`) at ``fault_at_s``.

Then trainers get ``grace_s`` to read what is left, the driver deletes the remaining steps,
and the namespace is listed: a key still there belongs to a step already deleted (a record
brought back), and is reported.  Every process is stopped by its process group; the store's
servers by pid.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.soak.accounting import load_dir, percentiles
from benchmarks.soak.events import EventLog, StepGate, Tail
from benchmarks.soak.faults import FAULTS
from benchmarks.soak.stores import StoreUnderTest
from benchmarks.soak.workload import owner_of, parse_rollout, step_prefix
from fdrr_dev.testing.process import free_port

__all__ = ["Scenario", "ScenarioRun", "gone_unread"]

ROOT = Path(__file__).resolve().parents[2]
FASTDEPLOY_26 = ROOT.parent / "shared" / "fastdeploy" / "2.6"
FD_PYTHON = ROOT / ".venv-fd" / "bin" / "python"


def _p2pstore_packages(directory: Path) -> Path:
    """A directory holding (links to) this environment's P2PStore client packages, for
    FastDeploy's process in the contract environment, which has none (same Python)."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    target = directory / "p2pstore-packages"
    target.mkdir(exist_ok=True)
    for name in ("p2pstore", "mooncake", "mooncake_transfer_engine_non_cuda.libs"):
        if (site / name).exists() and not (target / name).exists():
            (target / name).symlink_to(site / name)
    return target
MiB = 2**20
_TICK_S = 0.05
_RSS_EVERY_S = 0.5


def gone_unread(step: int, unread: list[str], waited_s: float, timeout_s: float,
                trainer_steps: dict[int, int], trainers: int) -> bool:
    """Whether the driver may delete ``step`` although ``unread`` (its rollouts' last
    turns) were not read: ``timeout_s`` has passed since every producer moved past it and
    the trainer owning each of them has read a record of a later step (trainers read
    step by step, so it went past a record the store no longer has), or ``4 × timeout_s``
    has passed whatever the trainers did.  A trainer that is merely behind (a saturating
    run) holds its step, and with it the producers at the step gate: its records are read,
    not deleted unread."""
    if waited_s > 4 * timeout_s:
        return True
    return waited_s > timeout_s and all(
        trainer_steps.get(owner_of(rid, trainers), -1) > step for rid in unread)


@dataclass
class Scenario:
    name: str
    store: str
    producers: int = 2
    trainers: int = 2
    kinds: tuple[str, ...] = ("a", "m")
    rate: float = 2.0
    """Records per second per producer (Poisson arrivals); 0: as fast as accepted."""
    duration_s: float = 30.0
    step_s: float = 2.0
    """Length of a training step: a rollout belongs to the step in which it starts."""
    turns: int = 3
    writer: dict[str, Any] = field(default_factory=dict)
    retention: dict[str, Any] = field(default_factory=lambda: {"ttl_s": 3600,
                                                               "sweep_interval_s": 5})
    fault: str | None = None
    fault_at_s: float = 10.0
    fault_args: dict[str, Any] = field(default_factory=dict)
    grace_s: float = 90.0
    persist: bool = False
    tmpfs_bytes: int = 0
    fastdeploy: bool = False
    """Producers on FastDeploy 2.6's own store path (:mod:`.fastdeploy_producer`) instead of
    RoutingWriter; trainers and the driver read and delete FastDeploy's layout."""
    step_timeout_s: float = 60.0
    """A step whose last turns are not all read is deleted this long after every producer
    passed it, once each trainer owning an unread one has read a later step's record (it
    went past: the record is gone), or four times as long after in any case."""
    max_steps_ahead: int = 8
    """Producers start step s only once steps up to s - max_steps_ahead are deleted."""
    raw_s: float = 0.0
    """Before the soak, measure the store's raw limit for this long (0: not measured)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def writer_config(self, workdir: Path) -> dict[str, Any]:
        config = {"mode": "process", "capacity_bytes": 128 * MiB, "close_timeout_s": 120,
                  "journal_dir": str(workdir / "journal" / "{dp_rank}"),
                  "dead_letter_dir": str(workdir / "dead" / "{dp_rank}")}
        config.update(self.writer)
        return config


_PAYLOAD_COMMANDS = frozenset({"HSET", "HGETALL", "HMGET", "HGET", "GET", "SET", "EXEC", "MULTI"})
"""Commands that copy record bytes (a put is MULTI, UNLINK, HSET, ZADD, EXEC: EXEC's time
is its commands'); the rest is the index, the expiry set and deletes."""


def _command_name(entry: dict[str, Any]) -> str:
    command = entry.get("command", b"")
    text = command.decode("utf-8", "replace") if isinstance(command, bytes) else str(command)
    return text.split(" ", 1)[0].upper()


class _Driver(threading.Thread):
    """Deletes steps by prefix in order, on its own store; logs each delete."""

    def __init__(self, run: ScenarioRun) -> None:
        super().__init__(name="soak-driver", daemon=True)
        self.run_ = run
        self.queue: queue.SimpleQueue[tuple[str, list[str]] | None] = queue.SimpleQueue()
        self.deleted: set[str] = set()
        self.command_us: list[int] = []
        self.index_us: list[int] = []

    def run(self) -> None:
        from fd_routing_replay.store import open_store

        store = open_store(self.run_.store_config, instrument=False)
        clients = [node.client(socket_timeout=30) for node in self.run_.store.redis_nodes()]
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    return
                self._delete_step(store, clients, *item)
        finally:
            for client in clients:
                try:
                    client.config_set("slowlog-log-slower-than", 10000)
                except Exception:  # noqa: BLE001 - the node may be down at the end
                    pass
                client.close()
            store.close()

    def _delete_step(self, store: Any, clients: list[Any], prefix: str, keys: list[str]) -> None:
        """Delete one step: by ``prefix``, or the exact ``keys`` when given (FastDeploy's
        P2PStore keys are not in our prefix index)."""
        for attempt in range(60):
            try:
                for client in clients:  # again each time: a node may have been restarted
                    client.config_set("slowlog-log-slower-than", 0)
                    client.slowlog_reset()
                began = time.monotonic()
                removed = store.delete(keys) if keys else \
                    store.delete_prefix([prefix]).get(prefix, 0)
                took = time.monotonic() - began
                entries = [entry for client in clients for entry in client.slowlog_get(20000)]
                durations = [int(entry["duration"]) for entry in entries]
                # what deleting costs Redis, apart from copying record payloads (HSET ...)
                index = [int(e["duration"]) for e in entries
                         if _command_name(e) not in _PAYLOAD_COMMANDS]
            except Exception as exc:  # noqa: BLE001 - a fault is on: try again
                self.run_.log.emit("delete_error", prefix=prefix, attempt=attempt,
                                   why=f"{type(exc).__name__}: {exc}"[:300], t=time.monotonic())
                time.sleep(0.5)
                continue
            self.command_us.extend(durations)
            self.index_us.extend(index)
            p50, p99 = percentiles(durations) if durations else (float("nan"),) * 2
            self.run_.log.emit("delete", prefix=prefix, t=began, dt=took, removed=removed,
                               commands=len(durations), command_p50_us=p50, command_p99_us=p99,
                               command_max_us=max(durations, default=0))
            self.deleted.add(prefix)
            return


class ScenarioRun:
    """Runs one :class:`Scenario` in ``workdir``; :meth:`run` returns its summary."""

    def __init__(self, scenario: Scenario, workdir: Path, run_tag: str) -> None:
        self.scenario = scenario
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tag = run_tag
        self.namespace = f"soak{run_tag}"
        self.log = EventLog(self.dir / "driver.jsonl")
        self.store = StoreUnderTest(scenario.store, self.dir, persist=scenario.persist,
                                    tmpfs_bytes=scenario.tmpfs_bytes)
        self.store_config: dict[str, Any] = {}
        self.processes: dict[str, subprocess.Popen] = {}
        self.store_losses: list[tuple[float, int | None]] = []
        self._workers: dict[int, int] = {}
        self._trainer_last: dict[int, str] = {}
        self._rss: dict[str, list[tuple[float, int]]] = {}
        self._cpu: dict[tuple[str, int], float] = {}
        self._step_done: dict[int, int] = {}
        self._required: dict[int, dict[str, str]] = {}
        self._last_turn: dict[str, int] = {}
        self._read: set[str] = set()
        self._trainer_step: dict[int, int] = {}
        self._step_ids: dict[int, list[str]] = {}
        self._extra_pids: dict[str, int] = {}
        self._submitted_all: set[int] = set()
        self._passed_at: dict[int, float] = {}
        self._lock = threading.Lock()

    # -- used by faults ------------------------------------------------------------------
    def fault_event(self, what: str, **fields: Any) -> None:
        self.log.emit("fault", what=what, t=time.monotonic(), **fields)

    def worker_pid(self, producer: int) -> int | None:
        with self._lock:
            return self._workers.get(producer)

    def trainer_reading(self, trainer: int) -> bool:
        with self._lock:
            return self._trainer_last.get(trainer) == "reading"

    def declare_store_loss(self, producer: int | None) -> None:
        self.store_losses.append((time.monotonic(), producer))

    def kill_trainer(self, trainer: int) -> int:
        process = self.processes[f"trainer{trainer}"]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        return process.pid

    # -- processes --------------------------------------------------------------------
    def _spawn(self, role: str, module: str, config: dict[str, Any],
               python: str | None = None, env: dict[str, str] | None = None) -> None:
        path = self.dir / f"{role}.json"
        path.write_text(json.dumps(config, indent=1))
        env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        with open(self.dir / f"{role}.out", "ab") as out:
            self.processes[role] = subprocess.Popen(
                [python or sys.executable, "-m", module, str(path)], cwd=ROOT, env=env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def start_trainer(self, index: int) -> None:
        s = self.scenario
        fd_p2p = s.fastdeploy and s.store == "p2pstore"
        self._spawn(f"trainer{index}", "benchmarks.soak.trainer", {
            "trainer": index, "trainers": s.trainers, "dir": str(self.dir), "run": self.tag,
            "store": self.store_config, "poll": "get" if fd_p2p else "list",
            "raw_geometry": fd_p2p, "fastdeploy": s.fastdeploy,
            "producer_files": [f"producer{p}.jsonl" for p in range(s.producers)]})

    def _start_producer(self, index: int, fd_rr: dict[str, Any]) -> None:
        s = self.scenario
        config = {"producer": index, "kind": s.kinds[index % len(s.kinds)], "dir": str(self.dir),
                  "run": self.tag, "fd_rr": fd_rr, "rate": s.rate, "duration_s": s.duration_s,
                  "step_s": s.step_s, "turns": s.turns, "seed": index,
                  "hold_open": s.store == "p2pstore", **s.extra}
        if not s.fastdeploy:
            self._spawn(f"producer{index}", "benchmarks.soak.producer", config)
            return
        config.update(fd_source=str(FASTDEPLOY_26), max_model_len=32768)
        if s.store == "local":  # one directory per producer: its StoreProcess clears it at start
            config.update(store_type="local", local_store_dir=str(self.store.root))
        else:
            config.update(store_type="rdma", rdma_store_server=self.store.redis_url(),
                          extra_path=str(_p2pstore_packages(self.dir)))
        env = {"P2P_PROTOCOL": "tcp", "POD_IP": f"127.0.0.1:{free_port()}",
               "P2P_LOG_DIR": str(self.dir / "p2pstore-logs"),
               "FD_LOG_DIR": str(self.dir / "fastdeploy-logs")}  # not ./log of the checkout
        self._spawn(f"producer{index}", "benchmarks.soak.fastdeploy_producer", config,
                    python=str(FD_PYTHON), env=env)

    def _stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait(10)
            else:
                try:  # the writer process of a producer that exited (never by a bare name)
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def raw_limit(self) -> dict[str, Any]:
        """MB/s of plain clients on this scenario's servers (:mod:`.raw`), one writer per
        producer, all at once: ``alone`` (writing a pool of the soak's records: the
        store's raw limit) and ``with_rig`` (generating each record as a producer does,
        with a reader per writer checking every byte, as the trainers do)."""
        s, store = self.scenario, self.store
        base: dict[str, Any] = {"kind": s.store, "duration_s": s.raw_s, "dir": str(self.dir),
                                "tag": self.tag}
        if s.store == "local":
            base["root"] = str(store.root)
        elif s.store in ("redis", "redis-cluster"):
            base.update(url=store.redis_url(), cluster=s.store == "redis-cluster")
        elif s.store == "mooncake":
            base["master_server"] = store.master.address
        else:
            base.update(metadata_server=store.redis_url(),
                        log_dir=str(self.dir / "p2pstore-logs"))
        out = {}
        for mode, roles in (("alone", ("alone",)), ("with_rig", ("writer", "reader"))):
            for role in roles:
                for index in range(s.producers):
                    self._spawn(f"raw{role}{index}", "benchmarks.soak.raw",
                                {**base, "index": index, "role": role})
            results, cpu = [], 0.0
            for role in roles:
                for index in range(s.producers):
                    name = f"raw{role}{index}"
                    process = self.processes.pop(name)
                    if process.wait(s.raw_s + 300) != 0:
                        raise RuntimeError(f"raw client {name} failed: "
                                           f"{(self.dir / f'{name}.out').read_text()[-2000:]}")
                    result = json.loads((self.dir / f"{name}.json").read_text())
                    cpu += result["cpu_s"]
                    if role != "reader":
                        results.append(result)
            seconds = max(r["seconds"] for r in results)
            total = sum(r["bytes"] for r in results)
            out[mode] = {"mb_per_s": total / seconds / 1e6,
                         "records_per_s": sum(r["records"] for r in results) / seconds,
                         "cpu_ns_per_byte": cpu / total * 1e9}
        return out

    # -- the loop ---------------------------------------------------------------------
    def _events(self, tails: dict[str, Tail]) -> None:
        for role, tail in tails.items():
            for event in tail.read():
                kind = event["e"]
                if role.startswith("producer"):
                    index = int(role[len("producer"):])
                    if kind == "worker" and event["pid"]:
                        with self._lock:
                            self._workers[index] = event["pid"]
                    elif kind == "fd_pids":  # FastDeploy's StoreProcess and Manager server
                        with self._lock:
                            self._workers[index] = event["store_process"]
                            self._extra_pids[f"manager{index}"] = event["manager"]
                    elif kind == "put" and event["ok"]:
                        rollout = parse_rollout(event["id"])
                        self._step_ids.setdefault(rollout.step, []).append(event["id"])
                        if rollout.turn >= self._last_turn.get(rollout.base, -1):
                            self._last_turn[rollout.base] = rollout.turn
                            self._required.setdefault(rollout.step, {})[rollout.base] = \
                                event["id"]
                    elif kind == "submitted_all":
                        self._submitted_all.add(index)
                    elif kind == "step_done":
                        self._step_done[index] = max(self._step_done.get(index, -1),
                                                     event["step"])
                else:
                    index = int(role[len("trainer"):])
                    with self._lock:
                        self._trainer_last[index] = kind
                    if kind == "read":
                        self._read.add(event["id"])
                        self._trainer_step[index] = max(self._trainer_step.get(index, -1),
                                                        parse_rollout(event["id"]).step)

    def _settled_steps(self, everything: bool = False) -> list[int]:
        """Steps to delete now: every producer has moved past them and every rollout's last
        accepted turn of them has been read — or one is missing (:func:`gone_unread`: a
        record lost, or died with its store), so producers waiting at the step gate go on."""
        s = self.scenario
        done = min((self._step_done.get(p, -1) for p in range(s.producers)), default=-1)
        now = time.monotonic()
        out = []
        for step, required in sorted(self._required.items()):
            prefix = step_prefix(self.tag, step)
            if prefix in self._queued:
                continue
            if step <= done:
                self._passed_at.setdefault(step, now)
            unread = [r for r in required.values() if r not in self._read]
            if everything or (step <= done and (not unread or gone_unread(
                    step, unread, now - self._passed_at[step], s.step_timeout_s,
                    self._trainer_step, s.trainers))):
                out.append(step)
        return out

    def _sample_rss(self) -> None:
        """Resident memory of every process, and the CPU time each has used so far."""
        now = time.monotonic()
        pids = {role: p.pid for role, p in self.processes.items() if p.poll() is None}
        with self._lock:
            pids.update({f"worker{i}": pid for i, pid in self._workers.items()})
            pids.update(self._extra_pids)
        pids.update(self.store.pids())
        pids["driver"] = os.getpid()
        ticks = os.sysconf("SC_CLK_TCK")
        for role, pid in pids.items():
            try:
                with open(f"/proc/{pid}/status") as status:
                    rss = next(int(line.split()[1]) for line in status
                               if line.startswith("VmRSS:"))
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except (OSError, StopIteration, ValueError):
                continue
            self._rss.setdefault(role, []).append((now, rss))
            self._cpu[(role, pid)] = (int(fields[11]) + int(fields[12])) / ticks
        for number, node in enumerate(self.store.redis_nodes()):  # data, not allocator
            try:  # a short timeout: a paused node must not stall this loop
                text = node.command("INFO", "memory", timeout=0.2).decode()
                used = int(next(line.split(":")[1] for line in text.splitlines()
                                if line.startswith("used_memory:")))
            except Exception:  # noqa: BLE001 - paused, restarting, killed
                continue
            self._rss.setdefault(f"redis{number}-used", []).append((now, used // 1024))

    def run(self) -> dict[str, Any]:
        s = self.scenario
        started = time.monotonic()
        self.store.start()
        self.store_config = self.store.config(self.namespace)
        if s.fastdeploy:  # read and delete what FastDeploy's own path writes
            if s.store == "local":
                self.store_config["local"]["layout"] = "fastdeploy"
            else:
                self.store_config["p2pstore"]["layout"] = "fastdeploy"
        raw = None
        fd_rr = {"enabled": True, "store": self.store_config, "writer": s.writer_config(self.dir),
                 "retention": dict(s.retention)}
        self._queued: set[str] = set()
        driver = _Driver(self)
        fault_thread = None
        try:
            if s.raw_s > 0:
                raw = self.raw_limit()
            driver.start()
            gate = StepGate(self.dir)
            gate.allow(s.max_steps_ahead - 1)
            for index in range(s.trainers):
                self.start_trainer(index)
            for index in range(s.producers):
                self._start_producer(index, fd_rr)
            tails = {f"producer{i}": Tail(self.dir / f"producer{i}.jsonl")
                     for i in range(s.producers)}
            tails.update({f"trainer{i}": Tail(self.dir / f"trainer{i}.jsonl")
                          for i in range(s.trainers)})
            t0 = time.monotonic()
            self.log.emit("start", t=t0, scenario=asdict(s))
            next_rss = 0.0
            producers = [self.processes[f"producer{i}"] for i in range(s.producers)]
            trainers_stop_at = release_at = None
            gated = -1
            release = self.dir / "release-producers"
            while True:
                now = time.monotonic()
                self._events(tails)
                if now >= next_rss:
                    self._sample_rss()
                    next_rss = now + _RSS_EVERY_S
                if s.fault and fault_thread is None and now - t0 >= s.fault_at_s:
                    fault_thread = threading.Thread(
                        target=FAULTS[s.fault], args=(self, s.fault_args), daemon=True)
                    fault_thread.start()
                for step in self._settled_steps():
                    self._queue_delete(driver, step)
                through = self._deleted_through(driver)
                if through != gated:
                    gate.allow(through + s.max_steps_ahead)
                    gated = through
                if len(self._submitted_all) == s.producers and not release.exists():
                    if release_at is None:
                        release_at = now + s.grace_s
                    required = [r for step in self._required.values() for r in step.values()]
                    if all(r in self._read for r in required) or now >= release_at:
                        release.write_text("")  # P2PStore: unread records die with their writer
                if all(p.poll() is not None for p in producers):
                    if trainers_stop_at is None:
                        (self.dir / "stop-trainers").write_text("")
                        trainers_stop_at = now + s.grace_s
                    trainers = [self.processes[f"trainer{i}"] for i in range(s.trainers)]
                    if (fault_thread is None or not fault_thread.is_alive()) and \
                            all(p.poll() is not None for p in trainers):
                        break
                    if now >= trainers_stop_at:
                        (self.dir / "stop-trainers").write_text("now")
                if now - t0 > s.duration_s + 600:
                    raise TimeoutError(f"scenario {s.name} on {s.store} did not finish")
                time.sleep(_TICK_S)
            self._events(tails)
            for step in self._settled_steps(everything=True):
                self._queue_delete(driver, step)
            driver.queue.put(None)
            driver.join(300)
            leftovers = self._leftovers()
        finally:
            self._stop_all()
            self.store.stop()
            self.log.close()
        summary = self._summary(driver, leftovers, time.monotonic() - started)
        if raw is not None:
            summary["raw"] = raw
            summary["raw_ratio"] = {mode: summary["mb_per_s"] / value["mb_per_s"]
                                    for mode, value in raw.items()}
        return summary

    def _deleted_through(self, driver: _Driver) -> int:
        """The highest step s such that every step up to s has been deleted."""
        step = -1
        while step_prefix(self.tag, step + 1) in driver.deleted:
            step += 1
        return step

    def _exact_deletes(self) -> bool:
        return self.scenario.fastdeploy and self.scenario.store == "p2pstore"

    def _queue_delete(self, driver: _Driver, step: int) -> None:
        prefix = step_prefix(self.tag, step)
        self._queued.add(prefix)
        keys = list(self._step_ids.get(step, [])) if self._exact_deletes() else []
        driver.queue.put((prefix, keys))

    def _leftovers(self) -> list[str]:
        """Keys of this run still stored after every step was deleted (then cleared)."""
        from fd_routing_replay.store import open_store

        store = open_store(self.store_config, instrument=False)
        try:
            if self._exact_deletes():
                keys = [k for ids in self._step_ids.values() for k in ids if store.exists(k)]
            else:
                keys = store.list(self.tag)
                store.clear()
        finally:
            store.close()
        return keys

    # -- the report --------------------------------------------------------------------
    def _summary(self, driver: _Driver, leftovers: list[str], wall_s: float) -> dict[str, Any]:
        from benchmarks.soak.events import read_all

        accounting = load_dir(self.dir, self.store_losses)
        out = accounting.summary()
        events = list(read_all(self.dir / "driver.jsonl"))
        deletes = [e for e in events if e["e"] == "delete"]
        out["deletes"] = len(deletes)
        out["delete_ms"] = [v * 1e3 for v in percentiles(e["dt"] for e in deletes)]
        out["delete_errors"] = sum(1 for e in events if e["e"] == "delete_error")
        cmd = percentiles(driver.command_us, (0.5, 0.99, 1.0)) if driver.command_us else []
        out["redis_command_us"] = cmd
        out["redis_other_command_us"] = percentiles(driver.index_us, (0.5, 0.99, 1.0)) \
            if driver.index_us else []
        out["faults"] = [{k: v for k, v in e.items() if k != "e"} for e in events
                         if e["e"] == "fault"]
        out["leftovers"] = leftovers
        out["rss_mb"] = _rss_summary(self._rss)
        cpu: dict[str, float] = {}
        for (role, _pid), seconds in self._cpu.items():
            cpu[role] = round(cpu.get(role, 0.0) + seconds, 2)
        out["cpu_s"] = cpu
        clients = sum(v for role, v in cpu.items()
                      if role.startswith(("producer", "worker", "trainer", "manager")))
        out["cpu_ns_per_byte"] = clients / out["bytes_durable"] * 1e9 \
            if out["bytes_durable"] else float("nan")
        out["wall_s"] = wall_s
        out["scenario"] = self.scenario.name
        out["offered_records_per_s"] = self.scenario.rate * self.scenario.producers
        out["store"] = self.scenario.store
        out["ok"] = bool(out["ok"]) and not leftovers
        return out


def _rss_summary(samples: dict[str, list[tuple[float, int]]]) -> dict[str, dict[str, float]]:
    """Per process role: peak RSS (MB), and the growth of the last third's peak over the
    middle third's (MB; about 0 when memory is bounded)."""
    out = {}
    for role, series in sorted(samples.items()):
        if not series:
            continue
        values = [kb / 1024 for _, kb in series]
        third = max(len(values) // 3, 1)
        middle, last = values[third:2 * third] or values, values[2 * third:] or values
        out[role] = {"peak": round(max(values), 1),
                     "growth": round(max(last) - max(middle), 1)}
    return out
