"""``fd-rr selftest``: prove routing capture on your own deployment, end to end.

Run it against a FastDeploy OpenAI API server started with the plugin in verification mode
(``capture.verify: true``): it sends a small, varied workload (shared prefixes, a long
prompt that chunks, ``n > 1``, two turns; :mod:`.selftest_workload`), waits for each
request's records in the configured store (``RoutingReader.wait_many``), checks every
stored row against the known function the hook recorded
(:func:`fd_routing_replay.reader.verification.check_record`) and the lengths against the
responses' token counts, and prints one pass/fail line per check (:mod:`.selftest_report`),
naming the first misplaced row by rollout, position and layer.  Exit status 1 when any
check fails.  The run's records are deleted afterwards (``--keep`` keeps them).
"""

from __future__ import annotations

import argparse
from typing import Any

from fd_routing_replay.cli.common import EXIT_FAILURE, EXIT_OK, open_store, print_json
from fd_routing_replay.cli.selftest_report import build_report
from fd_routing_replay.cli.selftest_workload import Workload, WorkloadSettings, http_json, run_id

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True,
                   help="the server's OpenAI API root, e.g. http://127.0.0.1:8180")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default 16)")
    p.add_argument("--n", type=int, default=2, dest="choices", help="choices of the n > 1 request (default 2)")
    p.add_argument("--shared-prefix-words", type=int, default=120,
                   help="words of the system prompt three requests share (default 120)")
    p.add_argument("--long-prompt-words", type=int, default=3000,
                   help="words of the long prompt; make it longer (in tokens) than the server's "
                        "max_num_batched_tokens so its prefill is chunked (default 3000)")
    p.add_argument("--prefix", default="fdrr-selftest",
                   help="rollout-id prefix of this run's requests (default fdrr-selftest)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for the records after the responses (default 120)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds to wait for one response (default 600)")
    p.add_argument("--keep", action="store_true", help="keep the run's records (deleted by default)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _model(url: str, given: str | None, timeout: float) -> str:
    if given:
        return given
    models = http_json(f"{url.rstrip('/')}/v1/models", timeout=timeout).get("data") or []
    if not models or not models[0].get("id"):
        raise LookupError(f"{url}: GET /v1/models names no model; pass --model")
    return str(models[0]["id"])


def _collect(reader: Any, wanted: list[tuple[str, int | None]], timeout: float) -> dict[str, Any]:
    """Each wanted record's verdict (None when it never arrived)."""
    from fd_routing_replay.errors import RecordError
    from fd_routing_replay.reader.verification import RecordVerdict, check_record

    ids = [rid for rid, _ in wanted]
    try:
        records: dict[str, Any] = reader.wait_many(ids, timeout)
    except (TimeoutError, RecordError):          # read each: the missing and the broken
        records = {}
        for rid in ids:
            try:
                records[rid] = reader.get(rid)
            except RecordError as exc:
                records[rid] = exc
    verdicts: dict[str, Any] = {}
    for rid, expected in wanted:
        record = records.get(rid)
        if isinstance(record, RecordError):
            verdicts[rid] = RecordVerdict(rid, expected_tokens=expected, error=f"unreadable: {record}")
        else:
            verdicts[rid] = None if record is None else check_record(record, expected_tokens=expected)
    return verdicts


def run(args: argparse.Namespace) -> int:
    from fd_routing_replay.reader import RoutingReader

    store = open_store(args)
    try:
        settings = WorkloadSettings(
            model=_model(args.url, args.model, args.request_timeout), max_tokens=args.max_tokens,
            choices=args.choices, shared_prefix_words=args.shared_prefix_words,
            long_prompt_words=args.long_prompt_words, timeout_s=args.request_timeout)
        workload = Workload(args.url, settings, run_id(args.prefix))
        reader = RoutingReader(store)
        verdicts: dict[str, Any] = {}
        try:
            # turn 0's record is read before turn 1 is sent: only_last_turn may retire it
            for phase in (workload.first_phase, workload.second_phase):
                exchanges = phase()
                wanted = [pair for exchange in exchanges for pair in exchange.records()]
                verdicts.update(_collect(reader, wanted, args.timeout))
        finally:
            if not args.keep:
                store.delete_prefix([workload.run])
        report = build_report(args.url, store.describe(), workload.run, workload.exchanges, verdicts)
    finally:
        store.close()
    if args.json:
        print_json(report.as_dict())
    else:
        print(report.text())
    return EXIT_OK if report.ok else EXIT_FAILURE
