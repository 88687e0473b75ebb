"""The shipped Grafana dashboard and Prometheus alert rules load and name only real metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from fd_routing_replay.capture import CAPTURE_GAUGES, CAPTURE_PREFIX
from fd_routing_replay.integrations.metrics import metric_names
from fd_routing_replay.metrics import LABELS
from fd_routing_replay.writer.metrics import GAUGES, PREFIX

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RULES = DEPLOY / "prometheus" / "fd-routing-replay-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "fd-routing-replay.json"
METRIC = re.compile(r"\bfd_rr_[a-z0-9_]+\b")
GAUGE_NAMES = {f"{PREFIX}_{n}" for n in GAUGES} | {f"{CAPTURE_PREFIX}_{n}" for n in CAPTURE_GAUGES}


def _rules() -> list[dict]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _dashboard_queries() -> list[str]:
    dashboard = _dashboard()
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return queries


def _expressions() -> list[str]:
    return [rule["expr"] for rule in _rules()] + _dashboard_queries()


def test_alert_rules_are_well_formed():
    rules = _rules()
    assert len(rules) >= 8
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "duplicate alert names"
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]


def test_dashboard_is_a_grafana_dashboard_with_unique_panel_ids():
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len(graphs) >= 8
    for panel in graphs:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            # every query honours the dashboard's namespace/store/rank selectors
            assert all(f'{label}=~"${label}"' in target["expr"] for label in LABELS), panel["title"]


def test_every_metric_named_exists():
    known = metric_names()
    named = {name for expr in _expressions() for name in METRIC.findall(expr)}
    assert named, "no metric found in the deploy files"
    assert named - known == set(), "the deploy files name metrics the package does not export"


@pytest.mark.parametrize("expr", _expressions())
def test_queries_use_each_metric_type_correctly(expr):
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    for func, name in re.findall(r"\b(rate|increase)\(\s*(fd_rr_[a-z0-9_]+)", expr):
        # rate()/increase() only of counters and histogram series, never of a gauge
        assert name.endswith(("_total", "_bucket", "_count", "_sum")), (func, name)
    for name in METRIC.findall(expr):
        if name.endswith("_bucket"):
            assert "histogram_quantile(" in expr, name
        if name in GAUGE_NAMES:
            assert not re.search(rf"\b(rate|increase)\(\s*{name}\b", expr), name
    for group in re.findall(r"\bby \(([^)]*)\)", expr):
        labels = {label.strip() for label in group.split(",")}
        assert labels <= set(LABELS) | {"le", "op"}, (expr, labels)
