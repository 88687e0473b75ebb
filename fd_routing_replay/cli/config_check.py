"""``fd-rr config check FILE``: validate a config file (with this shell's ``FD_RR_*``
variables applied) and print the effective configuration, passwords masked.

The store type must be a built-in backend or one registered under the store entry-point
group.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fd_routing_replay.cli.common import EXIT_OK, HelpFormatter, print_json
from fd_routing_replay.core.redact import redact_text
from fd_routing_replay.errors import RoutingReplayError

__all__ = ["check_store_type", "cmd_config_check", "config_arguments"]


def check_store_type(store_config: Any) -> str:
    """The backend a store config names; ConfigError naming the known ones if none is."""
    from fd_routing_replay.errors import ConfigError
    from fd_routing_replay.store.registry import (
        ENTRY_POINT_GROUP,
        known_store_types,
        store_type_of,
    )

    name = store_type_of(store_config)
    known = known_store_types()
    if name not in known:
        key = "store.url" if store_config.url else "store.type"
        raise ConfigError(f"{key}: unknown store type {name!r}; known types: {', '.join(known)} "
                          f"(third-party backends register under the entry-point group "
                          f"{ENTRY_POINT_GROUP!r})")
    return name


def cmd_config_check(args: argparse.Namespace) -> int:
    import yaml

    from fd_routing_replay.config import config_to_dict, load_config

    try:
        config = load_config(args.file)
        store_type = check_store_type(config.store)
    except RoutingReplayError as exc:
        if args.json:
            print_json({"file": args.file, "valid": False, "error": redact_text(str(exc))})
        raise
    effective = config_to_dict(config, redact=True)
    if args.json:
        print_json({"file": args.file, "valid": True, "store_type": store_type,
                    "config": effective})
    else:
        print(yaml.safe_dump(effective, sort_keys=False), end="")
        print(f"# {args.file}: valid (store type {store_type})", file=sys.stderr)
    return EXIT_OK


def config_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    check = sub.add_parser(
        "check", help="validate a file and print the effective config", allow_abbrev=False,
        formatter_class=HelpFormatter,
        description="Validate a YAML/JSON config (with the FD_RR_* variables of this shell "
                    "applied) and print the effective configuration, passwords masked. The "
                    "store type must be a built-in or a registered backend.",
        epilog="example:\n  fd-rr config check configs/redis.yaml --json")
    check.add_argument("file", help="the YAML or .json config file")
    check.add_argument("--json", action="store_true", help="print a JSON object instead")
    check.set_defaults(func=cmd_config_check)
