"""The ``fd-rr`` command: its table of subcommands, the argument parser and :func:`main`.

Every failure prints one clear ``error:`` line (passwords in URLs masked) and exits
non-zero; tracebacks are shown only with ``--debug``.  Exit status: 0 success, 1 failure,
2 usage error (argparse); ``fsck`` adds 1 = inconsistencies found and 3 = could not check.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

from fd_routing_replay._version import __version__
from fd_routing_replay.cli.common import (
    EXIT_FAILURE,
    EXIT_FSCK_ERROR,
    EXIT_INTERRUPTED,
    HelpFormatter,
    store_call_summary,
)
from fd_routing_replay.cli.config_check import config_arguments
from fd_routing_replay.cli.fsck import cmd_fsck, fsck_arguments
from fd_routing_replay.cli.records import (
    cmd_get,
    cmd_ls,
    cmd_show,
    get_arguments,
    ls_arguments,
    show_arguments,
)
from fd_routing_replay.cli.rm import cmd_rm, rm_arguments
from fd_routing_replay.core.redact import RedactingFilter, redact_text
from fd_routing_replay.errors import RoutingReplayError

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "main"]


@dataclass(frozen=True)
class Subcommand:
    """One ``fd-rr`` subcommand.  Add a command by appending one to :data:`SUBCOMMANDS`.

    Either ``run`` (with ``arguments`` adding its options) is given here, or ``load``
    returns a module exposing ``add_arguments(parser)`` and ``run(args) -> int``; it is
    called (and the module imported) only when its subcommand runs (keeps ``fd-rr ls``
    fast).
    """

    name: str
    help: str
    description: str
    examples: tuple[str, ...]
    run: Callable[[argparse.Namespace], int] | None = None
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    load: Callable[[], ModuleType] | None = None
    store_options: bool = True
    #: Exit status when the command fails with an error.
    error_status: int = EXIT_FAILURE


# The subcommands whose module is imported only when they run: each imports its own
# dependencies (the trainers' metrics for compare, ...).

def _doctor() -> ModuleType:
    from fd_routing_replay.cli import doctor

    return doctor


def _dead_letters() -> ModuleType:
    from fd_routing_replay.cli import dead_letters

    return dead_letters


def _compare() -> ModuleType:
    from fd_routing_replay.cli import compare

    return compare


def _selftest() -> ModuleType:
    from fd_routing_replay.cli import selftest

    return selftest


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("ls", "list keys (optionally under a prefix) or namespaces",
               "List the sorted keys of a namespace, all or those matching a boundary-safe "
               "prefix (exp:1 matches exp:1, exp:1:… and exp:1_…, never exp:10…). When there "
               "are none, stderr says which store and namespace were read.",
               ("fd-rr ls exp_epoch_3 --store local://./routing_replay_output",
                "fd-rr ls --namespaces --config configs/redis.yaml"),
               run=cmd_ls, arguments=ls_arguments),
    Subcommand("show", "header, shape and expert usage of a record",
               "Print a record's format, header, shape, dtype, size, creation time (UTC) and "
               "its expert load (min/max/mean per expert, unused experts, unrouted entries), "
               "summed over layers or for one layer row. The record is validated as the "
               "trainer's reader validates it.",
               ("fd-rr show 'exp_epoch_3_17:0:1:0' --config configs/redis.yaml",
                "fd-rr show 'exp_epoch_3_17:0:1:0' --layer 5 --json"),
               run=cmd_show, arguments=show_arguments),
    Subcommand("get", "save a record's ids as .npy",
               "Validate a record as the trainer's reader does and save its [layers, tokens, "
               "top_k] expert ids as a NumPy .npy file.",
               ("fd-rr get 'exp_epoch_3_17:0:1:0' -o routing.npy --config configs/local.yaml",),
               run=cmd_get, arguments=get_arguments),
    Subcommand("rm", "delete keys, or prefixes with --prefix",
               "Delete keys (printing how many existed), or with --prefix everything under "
               "each boundary-safe prefix, asking first unless --yes.",
               ("fd-rr rm 'exp_1:0:0' --store redis://127.0.0.1:6379/0",
                "fd-rr rm --prefix exp_epoch_2 exp_epoch_1 --yes --config configs/redis.yaml",
                "fd-rr rm --older-than 2h --dry-run --store local:///data/rr"),
               run=cmd_rm, arguments=rm_arguments),
    Subcommand("config", "configuration tools",
               "Configuration tools; `fd-rr config check FILE` validates a config file.",
               ("fd-rr config check configs/local.yaml",),
               arguments=config_arguments, store_options=False),
    Subcommand("doctor", "check RDMA devices, the store and its index",
               "Check that this node can store and read records: config, RDMA devices, "
               "Redis, opening the store, a record round trip and a sample of the index. "
               "Exit status 1 when a check failed.",
               ("fd-rr doctor --config configs/p2pstore-rdma.yaml",),
               load=_doctor),
    Subcommand("fsck", "find and repair index/payload inconsistencies",
               "Compare an indexed store's prefix index with its payloads; --repair drops "
               "dangling index entries and indexes unindexed payloads. Exit status: 0 "
               "consistent or repaired, 1 inconsistent, 2 usage error, 3 could not check.",
               ("fd-rr fsck --config configs/redis.yaml",
                "fd-rr fsck --repair --json --store redis://127.0.0.1:6379/0"),
               run=cmd_fsck, arguments=fsck_arguments, error_status=EXIT_FSCK_ERROR),
    Subcommand("dead-letters", "list, replay or drop the writer's dead letters",
               "List the operations the store rejected for good (ls), submit them again through "
               "a writer with the configured store once the cause is fixed (replay: those "
               "accepted are removed, those rejected again stay with the new error), or delete "
               "them (drop). The directory is the one the config and rank identity (--dp-rank, "
               "--tp-rank, --device-id) select, or --dir.",
               ("fd-rr dead-letters ls --config configs/redis.yaml",
                "fd-rr dead-letters replay --all --config configs/redis.yaml",
                "fd-rr dead-letters drop 00001764536512345678.0 --yes --dir /data/rr/dead"),
               load=_dead_letters),
    Subcommand("compare", "routing mismatch between a record and a trainer's routing",
               "Compare the record under KEY with the routing a trainer recomputed (a .npy "
               "file, [layers, tokens, top_k]): flip rate overall and per layer, tokens "
               "with a flipped layer, top-k overlap, expert load drift. Exit status 1 when "
               "--max-flip-rate is exceeded.",
               ("fd-rr compare 'exp_1:0:0' trainer_routing.npy --store local:///data/rr",),
               load=_compare),
    Subcommand("selftest", "prove capture end to end on a running server (verification mode)",
               "Drive a FastDeploy OpenAI API server whose plugin runs in verification mode "
               "(capture.verify: true) with a small workload (shared prefixes, a long prompt "
               "that chunks, n > 1, two turns), read its records from the configured store and "
               "check every row against the known pattern the hook recorded and every length "
               "against the responses' token counts; names the first misplaced row by rollout, "
               "position and layer. Exit status 1 when a check failed.",
               ("fd-rr selftest --url http://127.0.0.1:8180 --config /etc/fd_rr/config.yaml",
                "fd-rr selftest --url http://127.0.0.1:8180 --store local:///data/rr --json"),
               load=_selftest),
]


def _invoked(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word; fd-rr's own options are flags)."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argument parser; ``argv`` says which external subcommand's options to load."""
    parser = argparse.ArgumentParser(
        prog="fd-rr", allow_abbrev=False, formatter_class=HelpFormatter,
        description="Inspect and manage stored routing records. `fd-rr COMMAND --help` "
                    "describes a command, with an example.",
        epilog="exit status: 0 success, 1 failure (fsck: inconsistent), 2 usage error, "
               "3 fsck could not check")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--stats", action="store_true",
                        help="print the store calls the command made (count, errors, latency, "
                             "bytes) on stderr")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    store_opts = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    store_opts.add_argument("--config", help="YAML/JSON config (default: $FD_ROUTING_REPLAY_CONFIG)")
    store_opts.add_argument("--store", help="store URL, e.g. local:///data/rr or redis://host/0")
    store_opts.add_argument("--namespace", help="override the config's namespace")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    invoked = _invoked(argv)
    for command in SUBCOMMANDS:
        examples = "\n".join(f"  {line}" for line in command.examples)
        p = sub.add_parser(command.name, help=command.help, description=command.description,
                           epilog=f"example{'s' if len(command.examples) > 1 else ''}:\n"
                                  f"{examples}",
                           formatter_class=HelpFormatter,
                           parents=[store_opts] if command.store_options else [],
                           allow_abbrev=False)
        p.set_defaults(func=command.run, load_module=command.load,
                       error_status=command.error_status)
        if command.arguments is not None:
            command.arguments(p)
        elif command.load is not None and command.name == invoked:
            command.load().add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    args.opened = []
    try:
        if args.func is None:
            return args.load_module().run(args)
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (RoutingReplayError, LookupError, OSError, TimeoutError, ImportError) as exc:
        if args.debug:
            raise
        print(f"error: {redact_text(str(exc))}", file=sys.stderr)
        return args.error_status
    finally:
        if args.stats:
            for where, metrics in args.opened:
                print(redact_text(store_call_summary(where, metrics)), file=sys.stderr)
