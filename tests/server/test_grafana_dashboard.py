"""The Grafana dashboard in examples/grafana cannot drift from the metrics the server exports.

Every metric name in a panel's PromQL must be a sample the server's registry renders, every
label it selects or groups by must be a label of that metric, and every label value it
matches exactly (``counter="sp_admissions"``, ``tier="device"``, ...) must be one the
server reports. What the server renders comes from a real ``ServerMetrics`` whose stats are
``Talaria.stats()``'s snapshot of a live cluster (tiny random-weight models) that has served
one call and taken one hint, so every family has samples and every label value is the
runtime's own.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from talaria.api.stats import snapshot
from talaria.generation import SamplingParams, StopChecker
from talaria.runtime.live import LiveCluster
from talaria.runtime.streams import Finished
from talaria.server.metrics import ServerMetrics
from talaria.types import EventKind, TokenSeq
from tests.helpers import sk, tiny_cluster

DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "talaria-dashboard.json"

PROMQL_FUNCTIONS = {
    "histogram_quantile",
    "rate",
    "increase",
    "irate",
    "sum",
    "max",
    "min",
    "avg",
    "count",
}
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
PROMQL_KEYWORDS |= {"and", "or", "unless", "offset"}
COUNTER_FUNCTIONS = ("rate(", "increase(", "irate(")


# ---------------------------------------------------------------------- what is rendered
async def _serve_one_call_and_snapshot() -> dict[str, Any]:
    cluster = tiny_cluster()
    model = sorted(cluster.core.instances["cpu-0"].models)[0]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    async with LiveCluster(cluster.core, cluster.runners, session_idle_s=3600) as live:
        async with live.session(sk("s1")).lock:
            _, receive = await live.submit(
                sk("s1"), model, TokenSeq(range(1, 20)), params, StopChecker(params), forced=(3, 4)
            )
            async with receive:
                events = [ev async for ev in receive]
        assert isinstance(events[-1], Finished)
        live.event(sk("s1"), EventKind.TOOL_START, expected_s=0.4, tool="bash")
        return snapshot(live)


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, set[str]]]:
    """Every sample name the registry renders: its label names, each with its values."""
    stats = anyio.run(_serve_one_call_and_snapshot)
    metrics = ServerMetrics(lambda: stats)
    metrics.observe_request("chat_completions", "tiny", 200, 0.3)
    metrics.ttft.labels("tiny").observe(0.05)
    metrics.sct.observe(12.0)
    text, _ = metrics.render()
    out: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = out.setdefault(sample.name, {})
            for k, v in sample.labels.items():
                labels.setdefault(k, set()).add(v)
    return out


# ---------------------------------------------------------------------- what is drawn
def _dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def _panels(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in doc["panels"]:
        yield p
        yield from p.get("panels", [])


def _expressions(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target."""
    return [(p["title"], t["expr"]) for p in _panels(doc) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` reads: identifiers left once strings, label matchers,
    ranges and grouping clauses are gone, that are neither functions nor keywords."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}", " ", bare)
    bare = re.sub(r"\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", bare)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", bare):
        word, call = m.group(1), m.group(2)
        if call or word in PROMQL_KEYWORDS:
            assert call is None or word in PROMQL_FUNCTIONS, f"unexpected function {word}"
            continue
        names.add(word)
    return names


def selectors(expr: str) -> list[tuple[str, str, str, str]]:
    """(metric, label, operator, value) of every label matcher in ``expr``."""
    out = []
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", expr):
        for lm in re.finditer(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', m.group(2)):
            out.append((m.group(1), lm.group(1), lm.group(2), lm.group(3)))
    return out


def grouping_labels(expr: str) -> set[str]:
    out: set[str] = set()
    for m in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        out |= {s.strip() for s in m.group(1).split(",") if s.strip()}
    return out


def test_the_name_parser_finds_names_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, model) (rate(a_bucket{x="b_c", y=~"$v"}'
        "[$__rate_interval]))) / sum(rate(c_total[5m])) * 60 + d"
    )
    assert metric_names(expr) == {"a_bucket", "c_total", "d"}
    assert selectors(expr) == [("a_bucket", "x", "=", "b_c"), ("a_bucket", "y", "=~", "$v")]
    assert grouping_labels(expr) == {"le", "model"}


# ---------------------------------------------------------------------- the checks
def test_every_metric_in_the_dashboard_is_exported(
    rendered: dict[str, dict[str, set[str]]],
) -> None:
    exprs = _expressions(_dashboard())
    assert len(exprs) > 20
    used: set[str] = set()
    for title, expr in exprs:
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        missing = names - set(rendered)
        assert not missing, f"{title}: {sorted(missing)} not exported (expr {expr!r})"
        used |= names
    # the dashboard covers every family the server exports (``_created`` aside)
    families = {re.sub(r"_(bucket|count|sum|total|created)$", "", n) for n in rendered}
    shown = {re.sub(r"_(bucket|count|sum|total|created)$", "", n) for n in used}
    assert families - shown == set()


def test_every_label_matched_or_grouped_exists_with_its_values(
    rendered: dict[str, dict[str, set[str]]],
) -> None:
    for title, expr in _expressions(_dashboard()):
        labels_here = set().union(*(rendered.get(n, {}) for n in metric_names(expr)))
        for metric, label, op, value in selectors(expr):
            assert label in rendered.get(metric, {}), f"{title}: {metric} has no label {label}"
            if op == "=" and not value.startswith("$"):
                seen = rendered[metric][label]
                assert value in seen, f"{title}: {metric}{{{label}}} is never {value!r}: {seen}"
        extra = grouping_labels(expr) - labels_here
        assert not extra, f"{title}: groups by {sorted(extra)}, not labels of its metrics"


def test_template_variables_query_exported_labels(
    rendered: dict[str, dict[str, set[str]]],
) -> None:
    variables = [v for v in _dashboard()["templating"]["list"] if v["type"] == "query"]
    assert [v["name"] for v in variables] == ["instance"]
    for var in variables:
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
        assert m is not None, var["definition"]
        assert var["query"]["query"] == var["definition"]
        metric, label = m.groups()
        assert label in rendered[metric], f"${var['name']}: {metric} has no label {label}"


def test_histograms_and_counters_are_read_the_prometheus_way(
    rendered: dict[str, dict[str, set[str]]],
) -> None:
    """Histograms through histogram_quantile over rates of ``_bucket`` (or ``_sum`` over
    ``_count``), counters through rate() / increase(): never a raw cumulative value."""
    for title, expr in _expressions(_dashboard()):
        for name in metric_names(expr):
            if name.endswith("_bucket"):
                assert "histogram_quantile(" in expr and "le" in grouping_labels(expr), title
            if name.endswith(("_bucket", "_sum", "_count", "_total")):
                pattern = rf"(?:{'|'.join(map(re.escape, COUNTER_FUNCTIONS))})\s*{name}\b"
                assert re.search(pattern, expr), f"{title}: {name} outside rate()/increase()"


def test_the_dashboard_imports_into_grafana_10() -> None:
    doc = _dashboard()
    assert doc["schemaVersion"] >= 38  # Grafana 10.0
    assert [i["name"] for i in doc["__inputs"]] == ["DS_PROMETHEUS"]
    assert doc["__inputs"][0]["pluginId"] == "prometheus"
    assert doc["uid"] and doc["title"] and doc["id"] is None
    ids = [p["id"] for p in _panels(doc)]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in _panels(doc):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        mine = set(itertools.product(xs, ys))
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))
        assert all(t["datasource"] == p["datasource"] for t in p["targets"])
        assert p.get("description"), f"panel {p['title']!r} says nothing about itself"
