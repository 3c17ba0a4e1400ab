"""The replay's timeline: what each instance ran, and when each session's calls ran.

``plot_timeline`` draws one panel per chosen policy, all on one time axis (seconds from the
replay's start), so that a policy that finishes sooner is visibly shorter. In a panel, every
instance has a *slot row*: a coloured band per model slot (the model's weights active, from
its slot opening until the next switch begins), hatched grey while a switch copies weights;
the same bands show faintly behind the instance's session rows. Below it, one row per
session it served: each call is a thin line from its arrival to its admission (the wait for
its model's slot or for room) and a bar while it runs, dark for prefill (admission to first
token) and light for decode (to the last token); a black tick marks the session's end,
labelled with its SCT.

It draws from each policy's :class:`~talaria.sim.simulator.SimResult` (plain data: every
call's :class:`~talaria.sim.simulator.CallRecord`, every
:class:`~talaria.sim.simulator.SlotRecord`), which ``run_replay`` / ``run_embedded_replay``
hand to their ``on_result``: too large for ``results.json``. ``timeline_policies`` says which
policies get a panel (see there). PNG files, matplotlib's Agg backend.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from talaria.sim.simulator import CallRecord, SimResult
from talaria.swebench_replay.compare import PER_REQUEST

MAX_PANELS = 3
ROW_IN = 0.14  # figure height per row (inches)
SWITCH_COLOR = "0.55"


def timeline_policies(
    results: Mapping[str, Any], available: Collection[str], limit: int = MAX_PANELS
) -> list[str]:
    """The policies that get a panel, of those in ``available`` (references never). Up to
    ``limit`` policies: all of them; more: ``talaria``, ``round`` and the best per-request
    baseline (lowest SCT p50, then mean, of the baselines other than ``round``), the rest of
    the panels filled with the best of the others (ablations, ``talaria-no-hints``)."""
    entries = results["policies"]
    names = [n for n, p in entries.items() if n in available and not p.get("reference")]
    if len(names) <= limit:
        return names

    def by_sct(pool: Sequence[str]) -> list[str]:
        return sorted(pool, key=lambda n: (entries[n]["sct_p50_s"], entries[n]["sct_mean_s"], n))

    chosen = [n for n in ("talaria", "round") if n in names]
    per_request = by_sct([n for n in names if n in PER_REQUEST])
    chosen += per_request[:1]
    chosen += by_sct([n for n in names if n not in chosen])
    return chosen[:limit]


def _palette(results: Mapping[str, Any], runs: Mapping[str, SimResult]) -> dict[str, Any]:
    """A colour for each model the drawn runs used, in the workload's model order (other
    models after it): a model keeps its colour whichever policies are drawn."""
    models = list(results.get("workload", {}).get("models", []))
    used: set[str] = set()
    for run in runs.values():
        used |= {c.model for c in run.calls} | {s.model for s in run.slots}
    models += sorted(used - set(models))
    cmap = plt.get_cmap("tab10")
    return {m: cmap(i % 10) for i, m in enumerate(models) if m in used}


def _rows(run: SimResult, model_order: Sequence[str]) -> list[tuple[str, str | None]]:
    """The panel's rows top to bottom: per instance, its slot row ``(instance, None)`` and
    then a row ``(instance, session)`` per session it served, grouped by model, then by
    session start."""
    sessions = {s.session_id: s for s in run.sessions}
    rank = {m: i for i, m in enumerate(model_order)}
    served: dict[str, set[str]] = {}
    for c in run.calls:
        served.setdefault(c.instance, set()).add(c.session_id)
    for s in run.slots:
        served.setdefault(s.instance, set())
    rows: list[tuple[str, str | None]] = []
    for inst in sorted(served):

        def key(sid: str) -> tuple[int, float, str]:
            s = sessions.get(sid)
            return (rank.get(s.model, len(rank)) if s else len(rank), s.start_s if s else 0.0, sid)

        rows.append((inst, None))
        rows += [(inst, sid) for sid in sorted(served[inst], key=key)]
    return rows


def _draw_slots(
    ax: Axes, run: SimResult, rows: Sequence[tuple[str, str | None]], colors: Mapping[str, Any]
) -> None:
    """Slot bands on each instance's slot row, faint behind its session rows."""
    span: dict[str, list[int]] = {}
    for y, (inst, _) in enumerate(rows):
        span.setdefault(inst, []).append(y)
    for slot in run.slots:
        ys = span.get(slot.instance)
        if not ys:
            continue
        top, bottom = ys[0], ys[-1]
        if slot.open_s > slot.switch_s:
            ax.broken_barh(
                [(slot.switch_s, slot.open_s - slot.switch_s)],
                (top - 0.42, 0.84),
                facecolors=SWITCH_COLOR,
                hatch="////",
                edgecolor="white",
                linewidth=0,
            )
        width = slot.until_s - slot.open_s
        if width <= 0:
            continue
        color = colors[slot.model]
        ax.broken_barh([(slot.open_s, width)], (top - 0.42, 0.84), facecolors=color, linewidth=0)
        if bottom > top:  # faintly behind the instance's session rows
            ax.broken_barh(
                [(slot.open_s, width)],
                (top + 0.5, bottom - top),
                facecolors=color,
                alpha=0.09,
                linewidth=0,
                zorder=0,
            )


def _draw_calls(
    ax: Axes, calls: Sequence[CallRecord], row_of: Mapping[tuple[str, str], int], colors: Any
) -> None:
    """Per call: a thin line for the wait, a dark bar for prefill, a light one for decode."""
    waits: list[list[tuple[float, float]]] = []
    wait_colors = []
    bars: dict[tuple[int, str, bool], list[tuple[float, float]]] = {}
    for c in calls:
        y = row_of[(c.instance, c.session_id)]
        if c.admitted_s > c.arrival_s:
            waits.append([(c.arrival_s, y), (c.admitted_s, y)])
            wait_colors.append(colors[c.model])
        prefill = (c.admitted_s, max(0.0, c.first_token_s - c.admitted_s))
        decode = (c.first_token_s, max(0.0, c.finish_s - c.first_token_s))
        bars.setdefault((y, c.model, True), []).append(prefill)
        bars.setdefault((y, c.model, False), []).append(decode)
    ax.add_collection(LineCollection(waits, colors=wait_colors, linewidths=0.8, alpha=0.8))
    for (y, model, is_prefill), spans in bars.items():
        ax.broken_barh(
            spans,
            (y - 0.32, 0.64),
            facecolors=colors[model],
            alpha=1.0 if is_prefill else 0.5,
            linewidth=0,
        )


def _draw_ends(ax: Axes, run: SimResult, row_of: Mapping[tuple[str, str], int]) -> None:
    """A black tick at each session's end, on the row of the instance that answered its
    last call, labelled with its SCT."""
    last: dict[str, CallRecord] = {}
    for c in run.calls:
        if c.session_id not in last or c.index > last[c.session_id].index:
            last[c.session_id] = c
    for s in run.sessions:
        final = last.get(s.session_id)
        if final is None:
            continue
        y = row_of[(final.instance, s.session_id)]
        ax.plot([s.end_s, s.end_s], [y - 0.45, y + 0.45], color="black", linewidth=1.0)
        ax.annotate(
            f"{s.sct_s:,.0f} s" if s.sct_s >= 10 else f"{s.sct_s:.1f} s",
            (s.end_s, y),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=5.5,
        )


def _panel(
    ax: Axes,
    name: str,
    entry: Mapping[str, Any],
    run: SimResult,
    rows: Sequence[tuple[str, str | None]],
    colors: Mapping[str, Any],
) -> None:
    row_of = {(inst, sid): y for y, (inst, sid) in enumerate(rows) if sid is not None}
    _draw_slots(ax, run, rows, colors)
    _draw_calls(ax, run.calls, row_of, colors)
    _draw_ends(ax, run, row_of)
    for y, (_, sid) in enumerate(rows):
        if sid is None and y > 0:
            ax.axhline(y - 0.5, color="black", linewidth=0.6)
    labels = [f"{inst} slots" if sid is None else sid for inst, sid in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=6 if len(rows) <= 40 else 4)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", alpha=0.3)
    ends = [s.end_s for s in run.sessions]
    ax.set_title(
        f"{name}: SCT p50 {entry['sct_p50_s']:,.1f} s, p95 {entry['sct_p95_s']:,.1f} s, "
        f"last session done at {max(ends, default=0.0):,.1f} s; "
        f"{entry['model_switches']} model switches",
        fontsize=9,
        loc="left",
    )


def _legend_handles(colors: Mapping[str, Any]) -> list[Any]:
    handles: list[Any] = [Patch(facecolor=c, label=m) for m, c in colors.items()]
    handles += [
        Patch(facecolor=SWITCH_COLOR, hatch="////", edgecolor="white", label="switch (weights)"),
        Line2D([], [], color="0.3", linewidth=0.8, label="call waiting (arrival to admission)"),
        Patch(facecolor="0.3", label="prefill (to first token)"),
        Patch(facecolor="0.3", alpha=0.5, label="decode (to last token)"),
        Line2D([], [], color="black", linewidth=1.0, label="session end (SCT)"),
    ]
    return handles


def plot_timeline(
    results: Mapping[str, Any],
    runs: Mapping[str, SimResult],
    path: Path,
    policies: Sequence[str] | None = None,
) -> Path:
    """One timeline panel per policy of ``policies`` (default :func:`timeline_policies` of
    ``runs``), on a shared time axis, into the PNG file ``path``; ``results`` is the
    replay's document (titles, SCT figures, model order), ``runs`` each policy's result."""
    names = list(policies) if policies is not None else timeline_policies(results, runs)
    if not names:
        raise ValueError("no policy run to draw a timeline of")
    colors = _palette(results, {n: runs[n] for n in names})
    models = list(colors)
    panel_rows = [_rows(runs[n], models) for n in names]
    heights = [max(len(r), 4) for r in panel_rows]
    fig, axes = plt.subplots(
        len(names),
        1,
        sharex=True,
        squeeze=False,
        figsize=(14, 1.2 + sum(h * ROW_IN + 0.5 for h in heights)),
        dpi=120,
        layout="constrained",
        gridspec_kw={"height_ratios": heights},
    )
    for ax, name, rows in zip(axes[:, 0], names, panel_rows, strict=True):
        _panel(ax, name, results["policies"][name], runs[name], rows, colors)
    bottom = axes[-1, 0]
    bottom.set_xlabel("seconds from the replay's start")
    bottom.set_xlim(left=0)
    wl = results["workload"]
    fig.suptitle(
        f"Timeline: {wl['sessions']} sessions, {wl['calls']} calls, "
        f"{results['substrate']} on {results['hardware']}",
        fontsize=11,
    )
    fig.legend(
        handles=_legend_handles(colors),
        loc="outside lower center",
        ncol=4,
        fontsize=7,
        frameon=False,
    )
    fig.savefig(path)
    plt.close(fig)
    return path
