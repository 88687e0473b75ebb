"""``fd-rr dead-letters ls|replay|drop``: what the store rejected for good, and recovery.

A dead letter is an operation the writer could not apply and will not retry by itself
(docs/operations.md): ``NAME.json`` (the operation and the error), ``NAME.reason`` (one
line) and, for a put, ``NAME.rr`` (the record).  These commands work on one writer's
dead-letter directory — the one its config and rank identity select, or ``--dir``:

* ``ls`` lists them (keys and reasons escaped: they may hold any character);
* ``replay`` submits them again through a :class:`~fd_routing_replay.writer.RoutingWriter`
  with the configured store, so every writer rule applies (key and record checks,
  ``only_last_turn``, retries, the journal when the store is down).  A dead letter the
  writer accepts (written, or journaled for later) is removed with its ``.reason``; one it
  rejects again stays, its ``.json`` and ``.reason`` updated with the new error;
* ``drop`` removes dead letters (all three files) after confirmation.

The replaying writer takes the rank's journal lock: stop the engine of that rank first,
or pass ``--journal-dir``.  Functions here take parsed arguments and a config and return
an exit status, so tests call them without a shell.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fd_routing_replay.codec import decode_record
from fd_routing_replay.config import RoutingReplayConfig, config_to_dict, load_config
from fd_routing_replay.core.paths import RankIdentity
from fd_routing_replay.errors import RoutingReplayError
from fd_routing_replay.writer.journal import (
    OP_SUFFIX,
    RECORD_SUFFIX,
    DeadLetters,
    resolve_writer_directories,
)
from fd_routing_replay.writer.operation import check_sidecar

__all__ = ["add_arguments", "cmd_drop", "cmd_ls", "cmd_replay", "config_from_args",
           "dead_letter_directory", "escape", "run"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


# -- arguments and configuration ---------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``ls``, ``replay`` and ``drop`` (the store options come from ``fd-rr``)."""
    where = argparse.ArgumentParser(add_help=False)
    # The store options again, so they may follow the action too (``dead-letters ls
    # --config X``); SUPPRESS keeps a value given before the action.
    where.add_argument("--config", default=argparse.SUPPRESS,
                       help="YAML/JSON config (default: $FD_ROUTING_REPLAY_CONFIG)")
    where.add_argument("--store", default=argparse.SUPPRESS, help="store URL")
    where.add_argument("--namespace", default=argparse.SUPPRESS,
                       help="override the config's namespace")
    where.add_argument("--dir", help="the dead-letter directory (default: the one the config "
                                     "and rank identity select)")
    where.add_argument("--dp-rank", type=int, help="rank identity: data-parallel rank")
    where.add_argument("--tp-rank", type=int, help="rank identity: tensor-parallel rank")
    where.add_argument("--device-id", help="rank identity: device id")
    sub = parser.add_subparsers(dest="dead_letters_command", required=True, metavar="ACTION")
    p = sub.add_parser("ls", parents=[where], help="list dead letters and why they failed")
    p.add_argument("--json", action="store_true", help="print a JSON object instead")
    p = sub.add_parser("replay", parents=[where],
                       help="submit dead letters to a writer again; remove those accepted")
    p.add_argument("names", nargs="*", metavar="NAME", help="dead letters to replay (see ls)")
    p.add_argument("--all", action="store_true", help="replay every dead letter")
    p.add_argument("--journal-dir", help="journal of the replaying writer (default: the rank's)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for the store (default: writer.close_timeout_s)")
    p = sub.add_parser("drop", parents=[where], help="delete dead letters for good")
    p.add_argument("names", nargs="*", metavar="NAME", help="dead letters to delete (see ls)")
    p.add_argument("--all", action="store_true", help="delete every dead letter")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")


def config_from_args(args: argparse.Namespace) -> RoutingReplayConfig:
    """The config ``--config`` names (or ``$FD_ROUTING_REPLAY_CONFIG``), with ``--store``
    and ``--namespace`` applied."""
    store: dict[str, Any] = {}
    if getattr(args, "store", None):
        store["url"] = args.store
    if getattr(args, "namespace", None):
        store["namespace"] = args.namespace
    return load_config(getattr(args, "config", None), {"store": store} if store else None)


def _identity(args: argparse.Namespace) -> RankIdentity:
    device = getattr(args, "device_id", None)
    if isinstance(device, str) and device.isdigit():
        device = int(device)
    return RankIdentity(dp_rank=getattr(args, "dp_rank", None),
                        tp_rank=getattr(args, "tp_rank", None), device_id=device)


def dead_letter_directory(args: argparse.Namespace, config: RoutingReplayConfig) -> Path:
    """``--dir``, or the dead-letter directory of the rank the arguments name."""
    if getattr(args, "dir", None):
        return Path(args.dir).expanduser().absolute()
    return resolve_writer_directories(config.store, config.writer, _identity(args)).dead_letter


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fd-rr dead-letters``."""
    config = config_from_args(args)
    command = {"ls": cmd_ls, "replay": cmd_replay, "drop": cmd_drop}[args.dead_letters_command]
    return command(args, config)


# -- output ------------------------------------------------------------------------------------

def escape(text: object) -> str:
    """``text`` safe to print on one line: backslashes doubled; control, format, line and
    other non-printable characters (tabs included) as ``\\xNN`` / ``\\uNNNN`` escapes."""
    text = text if isinstance(text, str) else str(text)
    out = []
    for char in text:
        if char == "\\":
            out.append("\\\\")
        elif char.isprintable() and (char == " " or not char.isspace()):
            out.append(char)
        else:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else
                       f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def _when(value: Any) -> str:
    try:
        return datetime.fromtimestamp(float(value), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (TypeError, ValueError, OverflowError, OSError):
        return "-"


def _target(sidecar: dict[str, Any]) -> str:
    """What the operation was about: its key, targets or rollout id."""
    kind = sidecar.get("op")
    if kind == "put":
        return str(sidecar.get("key", ""))
    if kind == "retire":
        return str(sidecar.get("rollout_id", ""))
    values = sidecar.get("keys" if kind == "delete" else "prefixes")
    if isinstance(values, list):
        return ",".join(str(v) for v in values)
    return str(sidecar.get("journal_entry", ""))


@dataclass
class _Entry:
    name: str
    sidecar: dict[str, Any] | None
    problem: str | None = None  # why the sidecar cannot be used

    def summary(self, dead: DeadLetters) -> dict[str, Any]:
        sidecar = self.sidecar or {}
        return {"name": self.name, "op": sidecar.get("op", "?"), "target": _target(sidecar),
                "rollout_id": sidecar.get("rollout_id"), "failed_at": sidecar.get("failed_at"),
                "error_type": sidecar.get("error_type"),
                "reason": self.problem or sidecar.get("reason", ""),
                "error": sidecar.get("error"),
                "has_record": dead.path(self.name, RECORD_SUFFIX).exists()}


def _load(dead: DeadLetters, name: str) -> _Entry:
    try:
        return _Entry(name, dead.load(name))
    except (ValueError, RoutingReplayError) as exc:
        return _Entry(name, None, f"unreadable sidecar: {exc}")


# -- ls ----------------------------------------------------------------------------------------

def cmd_ls(args: argparse.Namespace, config: RoutingReplayConfig) -> int:
    """List the dead letters of one directory, oldest first."""
    directory = dead_letter_directory(args, config)
    if not directory.is_dir():
        print(f"no dead letters: {escape(directory)} does not exist", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"directory": str(directory), "dead_letters": []}, indent=2))
        return EXIT_OK
    dead = DeadLetters(directory)
    rows = [_load(dead, name).summary(dead) for name in dead.names()]
    if getattr(args, "json", False):
        print(json.dumps({"directory": str(directory), "dead_letters": rows}, indent=2,
                         ensure_ascii=True, default=str))
        return EXIT_OK
    for row in rows:
        error = f" ({row['error_type']}: {row['error']})" if row["error_type"] else ""
        print("\t".join((row["name"], escape(row["op"]), escape(row["target"]),
                         _when(row["failed_at"]), "record" if row["has_record"] else "-",
                         escape(f"{row['reason']}{error}"))))
    print(f"{len(rows)} dead letter(s) in {escape(directory)}", file=sys.stderr)
    return EXIT_OK


# -- selection ---------------------------------------------------------------------------------

def _select(args: argparse.Namespace, dead: DeadLetters) -> list[str] | None:
    """The names ``args`` selects (all with ``--all``), or None after printing why not."""
    names = list(getattr(args, "names", []) or [])
    if getattr(args, "all", False):
        if names:
            print("error: give NAMEs or --all, not both", file=sys.stderr)
            return None
        return dead.names()
    if not names:
        print("error: name the dead letters (see 'fd-rr dead-letters ls') or pass --all",
              file=sys.stderr)
        return None
    missing = []
    for name in names:
        try:
            if not dead.path(name, OP_SUFFIX).exists():
                missing.append(name)
        except ValueError:
            missing.append(name)
    if missing:
        print(f"error: no dead letter named {', '.join(escape(n) for n in missing)} in "
              f"{escape(dead.directory)}", file=sys.stderr)
        return None
    return names


# -- drop --------------------------------------------------------------------------------------

def cmd_drop(args: argparse.Namespace, config: RoutingReplayConfig) -> int:
    """Delete dead letters (record, sidecar and reason) after confirmation."""
    dead = DeadLetters(dead_letter_directory(args, config))
    names = _select(args, dead)
    if names is None:
        return EXIT_USAGE
    if not names:
        print("no dead letters; nothing dropped")
        return EXIT_OK
    if not getattr(args, "yes", False):
        if not sys.stdin.isatty():
            raise RoutingReplayError("refusing to drop dead letters without confirmation: "
                                     "stdin is not a terminal; pass --yes")
        answer = input(f"delete {len(names)} dead letter(s) from {dead.directory} for good? "
                       f"[y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("aborted; nothing dropped")
            return EXIT_FAILURE
    for name in names:
        entry = _load(dead, name)
        dead.remove(name)
        print(f"dropped\t{name}\t{escape(_target(entry.sidecar or {}))}")
    print(f"dropped {len(names)} dead letter(s)")
    return EXIT_OK


# -- replay ------------------------------------------------------------------------------------

def _identity_of(sidecar: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two sidecars the same operation (a re-filed dead letter matches its
    original)."""
    kind = sidecar.get("op")
    return (kind, _target(sidecar))


def _submit(writer: Any, dead: DeadLetters, entry: _Entry) -> str | None:
    """Hand one dead letter to ``writer``; the reason it cannot be, or None."""
    sidecar = entry.sidecar
    if sidecar is None:
        return entry.problem
    record = None
    try:
        if check_sidecar(sidecar, f"dead letter {entry.name}")["op"] == "put":
            path = dead.path(entry.name, RECORD_SUFFIX)
            if not path.exists():
                return f"no record file {path.name}: nothing to replay"
            record = decode_record(path.read_bytes(), verify=True)
        # As first described: an engine's rows with their padding and per-layer split, a
        # tail (prefix omission) with the stored turn it continues (re-filed if that is gone).
        if not writer.resubmit(sidecar, record):
            return "the writer dropped it (its memory and journal are full)"
    except (ValueError, TypeError, RoutingReplayError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _writer_for(config: RoutingReplayConfig, args: argparse.Namespace, record_format: str,
                dead_dir: Path) -> Any:
    from fd_routing_replay.writer import RoutingWriter

    writer_config = config_to_dict(config)["writer"]
    writer_config.update(mode="thread", dead_letter_dir=str(dead_dir), clear_on_start=False,
                         metrics_port=0, full_policy="spill")
    if getattr(args, "journal_dir", None):
        writer_config["journal_dir"] = str(Path(args.journal_dir).expanduser().absolute())
    return RoutingWriter(config.store, writer_config,
                         only_last_turn=config.retention.only_last_turn,
                         record_format=record_format, identity=_identity(args))


def cmd_replay(args: argparse.Namespace, config: RoutingReplayConfig) -> int:
    """Submit dead letters to a writer again, in order; remove those it accepts."""
    dead = DeadLetters(dead_letter_directory(args, config))
    names = _select(args, dead)
    if names is None:
        return EXIT_USAGE
    if not names:
        print("no dead letters; nothing replayed")
        return EXIT_OK
    timeout = getattr(args, "timeout", None)
    timeout = config.writer.close_timeout_s if timeout is None else timeout
    entries = [_load(dead, name) for name in names]
    failures: dict[str, str] = {}
    queued: dict[str, str] = {}  # accepted, but waiting in the journal for the store
    accepted: list[_Entry] = []
    # Consecutive entries of one record format share a writer (order is kept).
    runs: list[tuple[str, list[_Entry]]] = []
    for entry in entries:
        fmt = str((entry.sidecar or {}).get("format") or config.capture.record_format)
        if runs and runs[-1][0] == fmt:
            runs[-1][1].append(entry)
        else:
            runs.append((fmt, [entry]))
    for fmt, run_entries in runs:
        scratch = Path(tempfile.mkdtemp(prefix=".replay-", dir=dead.directory))
        try:
            writer = _writer_for(config, args, fmt, scratch)
            submitted: list[_Entry] = []
            try:
                for entry in run_entries:
                    problem = _submit(writer, dead, entry)
                    if problem is None:
                        submitted.append(entry)
                    else:
                        failures[entry.name] = problem
                writer.flush(timeout)
            finally:
                writer.close(timeout)
            refiled = _refiled(DeadLetters(scratch))
            waiting = _journaled(writer.journal)
            for entry in submitted:
                identity = _identity_of(entry.sidecar or {})
                if refiled[identity]:
                    sidecar = refiled[identity].popleft()
                    failures[entry.name] = (f"{sidecar.get('reason', 'rejected again')}: "
                                            f"{sidecar.get('error_type', '')}: "
                                            f"{sidecar.get('error', '')}")
                    continue
                if waiting[identity]:
                    waiting[identity] -= 1
                    queued[entry.name] = str(writer.journal.directory)
                accepted.append(entry)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    for entry in accepted:
        dead.remove(entry.name)
        status = "queued" if entry.name in queued else "replayed"
        note = f"\tin the journal {escape(queued[entry.name])} until the store is back" \
            if entry.name in queued else ""
        print(f"{status}\t{entry.name}\t{escape(_target(entry.sidecar or {}))}{note}")
    for entry in entries:
        problem = failures.get(entry.name)
        if problem is None:
            continue
        if entry.sidecar is not None:
            sidecar = dict(entry.sidecar)
            sidecar.update(replay_failed_at=time.time(), replay_error=problem)
            dead.update(entry.name, sidecar, sidecar.get("reason", "dead letter"),
                        f"replay failed: {problem}")
        print(f"failed\t{entry.name}\t{escape(_target(entry.sidecar or {}))}\t{escape(problem)}")
    print(f"replayed {len(accepted) - len(queued)} of {len(entries)} dead letter(s)"
          + (f"; {len(queued)} queued in the journal (the store did not answer in time; "
             f"the next writer there replays them)" if queued else "")
          + (f"; {len(failures)} failed and stay in {escape(dead.directory)}" if failures
             else ""))
    return EXIT_FAILURE if failures else EXIT_OK


def _refiled(scratch: DeadLetters) -> defaultdict[tuple[Any, ...], deque[dict[str, Any]]]:
    """Dead letters the replaying writer filed, by operation identity, oldest first."""
    out: defaultdict[tuple[Any, ...], deque[dict[str, Any]]] = defaultdict(deque)
    for name in scratch.names():
        try:
            sidecar = scratch.load(name)
        except (ValueError, RoutingReplayError, OSError):
            continue
        out[_identity_of(sidecar)].append(sidecar)
    return out


def _journaled(journal: Any) -> defaultdict[tuple[Any, ...], int]:
    """Operations left in a writer's journal, by identity (a count each)."""
    out: defaultdict[tuple[Any, ...], int] = defaultdict(int)
    for entry in journal.scan():
        try:
            out[_identity_of(journal.load_op(entry))] += 1
        except (ValueError, RoutingReplayError, OSError):
            continue
    return out
