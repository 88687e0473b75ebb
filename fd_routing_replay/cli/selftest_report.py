"""``fd-rr selftest``'s verdict: one pass/fail line per check, from the records' verdicts.

The row checks (:func:`fd_routing_replay.reader.verification.check_record`) run over every
record; the feature checks then look at the records of the requests that exercised a
feature (prefix-cache hits from ``usage.prompt_tokens_details.cached_tokens``, the long
prompt, ``n`` choices, the second turn).  Preemption, the PD hand-over and CPU swap are
invisible through the API: every row they moved is covered by the row checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fd_routing_replay.reader.verification import RecordVerdict, RowFault

__all__ = ["PASS", "FAIL", "SKIP", "Check", "SelftestReport", "build_report"]

PASS, FAIL, SKIP = "pass", "fail", "skip"

NOTE = ("preemption, the PD hand-over and CPU swap are not visible through the API; every row "
        "they moved is covered by the row checks above")


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str


@dataclass
class SelftestReport:
    """Everything ``fd-rr selftest`` prints (``--json``: :meth:`as_dict`)."""

    url: str
    store: str
    run: str
    checks: list[Check] = field(default_factory=list)
    verdicts: list[RecordVerdict] = field(default_factory=list)
    first_fault: RowFault | None = None
    period: int = 0

    @property
    def ok(self) -> bool:
        return all(check.status != FAIL for check in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "url": self.url, "store": self.store, "run": self.run,
                "period": self.period,
                "checks": [{"name": c.name, "status": c.status, "detail": c.detail} for c in self.checks],
                "first_misplaced_row": None if self.first_fault is None else {
                    "rollout_id": self.first_fault.rollout_id, "position": self.first_fault.position,
                    "layer_row": self.first_fault.layer_row, "decoder_layer": self.first_fault.decoder_layer,
                    "kind": self.first_fault.kind, "detail": self.first_fault.detail},
                "records": [v.as_dict() for v in self.verdicts], "note": NOTE}

    def text(self) -> str:
        lines = [f"fd-rr selftest: {self.url} -> {self.store} (run {self.run}"
                 + (f", positions told apart modulo {self.period})" if self.period else ")")]
        width = max(len(c.name) for c in self.checks) + 2 if self.checks else 0
        lines += [f"{c.status.upper():<5} {c.name:<{width}}{c.detail}" for c in self.checks]
        lines.append(f"note: {NOTE}")
        if self.first_fault is not None:
            lines.append(f"first misplaced row: {self.first_fault.describe()}")
        lines.append(f"result: {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)


def _status(failed: bool) -> str:
    return FAIL if failed else PASS


def _faults(verdicts: list[RecordVerdict], kind: str) -> tuple[int, str]:
    count = sum(v.counts[kind] for v in verdicts)
    first = next((f for v in verdicts for f in v.faults if f.kind == kind), None)
    return count, "" if first is None else f"; first: {first.describe()}"


def _records_ok(verdicts: list[RecordVerdict | None]) -> bool:
    return bool(verdicts) and all(v is not None and v.ok for v in verdicts)


def build_report(url: str, store: str, run: str, exchanges: list[Any],
                 verdicts: dict[str, RecordVerdict | None]) -> SelftestReport:
    """The checks over ``exchanges`` (:class:`~fd_routing_replay.cli.selftest_workload.Exchange`)
    and the verdict of each record they should have produced (None: never stored)."""
    report = SelftestReport(url, store, run)
    found = [v for v in verdicts.values() if v is not None]
    report.verdicts = found
    report.period = next((v.period for v in found if v.period), 0)
    checks = report.checks

    failed = [e for e in exchanges if e.error is not None]
    checks.append(Check("requests", _status(bool(failed)), f"{len(exchanges) - len(failed)} of {len(exchanges)} "
                        "answered" + (f"; {failed[0].name}: {failed[0].error}" if failed else "")))
    absent = [rid for rid, v in verdicts.items() if v is None]
    unmarked = [v for v in found if v.error is not None]
    detail = f"{len(found)} of {len(verdicts)} stored"
    if absent:
        detail += f"; never stored: {', '.join(absent[:3])}" + (" ..." if len(absent) > 3 else "")
    if unmarked:
        detail += f"; {unmarked[0].rollout_id}: {unmarked[0].error}"
    checks.append(Check("records", _status(bool(absent or unmarked or not verdicts)), detail))
    checked = [v for v in found if v.error is None]
    wrong = [v for v in checked if not v.token_count_ok]
    checks.append(Check("token_counts", _status(bool(wrong)),
                        "every record has prompt + completion - 1 positions" if not wrong else
                        f"{len(wrong)} records of the wrong length; {wrong[0].rollout_id}: "
                        f"{wrong[0].num_tokens} positions, the response says {wrong[0].expected_tokens}"))
    rows = sum(v.rows_checked for v in checked)
    for name, kind, good in (
            ("complete_rows", "missing", f"{rows} rows checked, none without routing"),
            ("recorded_values", "foreign", "every row holds a verification value"),
            ("positions", "position", "no row holds another position's values"),
            ("layer_rows", "layer", "no row holds another MoE layer's values")):
        count, first = _faults(checked, kind)
        checks.append(Check(name, _status(bool(count)), good if not count else f"{count} rows{first}"))
    checks.append(_gather_check(checked))
    checks.extend(_feature_checks(exchanges, verdicts))
    report.first_fault = next((v.first_fault for e in exchanges for rid, _ in e.records()
                               if (v := verdicts.get(rid)) is not None and v.first_fault is not None), None)
    return report


def _gather_check(checked: list[RecordVerdict]) -> Check:
    count, first = _faults(checked, "gather")
    ranks: dict[int, int] = {}
    for verdict in checked:
        for rank, rows in verdict.ranks.items():
            ranks[rank] = ranks.get(rank, 0) + rows
    shown = ", ".join(f"rank {rank}: {rows}" for rank, rows in sorted(ranks.items()))
    if count:
        return Check("tp_ep_gather", FAIL, f"{count} rows in another rank's share{first}")
    if len(ranks) <= 1:
        return Check("tp_ep_gather", SKIP,
                     f"every row routed by one rank ({shown or 'none'}): no TP x EP all-gather to check")
    return Check("tp_ep_gather", PASS, f"rows routed by {shown}; each in its rank's share")


def _feature_checks(exchanges: list[Any], verdicts: dict[str, RecordVerdict | None]) -> list[Check]:
    def of(exchange: Any) -> list[RecordVerdict | None]:
        return [verdicts.get(rid) for rid, _ in exchange.records()]

    checks = []
    hits = [e for e in exchanges if e.response is not None and e.cached_tokens > 0
            and len(e.records()) == 1]
    if not hits:
        checks.append(Check("prefix_cache", SKIP, "the server reported no cached prompt tokens "
                            "(usage.prompt_tokens_details.cached_tokens); is prefix caching on?"))
    else:
        bad = [e for e in hits if not (v := of(e)[0]) or v.faults_before(e.cached_tokens)]
        cached = sum(e.cached_tokens for e in hits)
        checks.append(Check("prefix_cache", _status(bool(bad)),
                            f"{cached} cached prompt tokens in {len(hits)} requests; "
                            + ("their rows are exact" if not bad else f"{bad[0].rollout_id}: a cached "
                               "position holds the wrong row")))
    for name, label, exchange_name in (("chunked_prefill", "the long prompt", "long"),
                                       ("n_choices", "the n-choice request", "choices")):
        mine = [e for e in exchanges if e.name == exchange_name and e.response is not None]
        if not mine:
            checks.append(Check(name, FAIL, f"{label} got no answer"))
            continue
        exchange = mine[0]
        records = of(exchange)
        detail = (f"{exchange.prompt_tokens}-token prompt" if exchange_name == "long"
                  else f"{len(records)} of {exchange.body.get('n')} choices recorded")
        failed = not _records_ok(records) or (exchange_name == "choices"
                                              and len(records) != exchange.body.get("n"))
        checks.append(Check(name, _status(failed), detail + ("; exact" if not failed else "; not exact")))
    turns = [e for e in exchanges if e.name == "chat"]
    records = [v for e in turns for v in of(e)]
    answered = len(turns) == 2 and all(e.response is not None for e in turns)
    checks.append(Check("multi_turn", _status(not answered or not _records_ok(records)),
                        f"{len(records)} turns recorded" + ("; exact" if answered and _records_ok(records)
                                                             else "; not exact")))
    return checks
