"""Tables and plots from ``results.json`` documents (never from live objects).

``policy_table`` renders the per-policy summary with rich; ``plot_sct_cdf`` draws every
policy's session-completion-time CDF; ``sweep_table`` / ``plot_sweep`` do the same for a
sensitivity sweep. Plots are PNG files written with matplotlib's Agg backend. The replay's
timeline (``timeline.png``) needs every call's and slot's timings, which the document does
not keep: it is drawn by :mod:`talaria.swebench_replay.timeline` from the runs themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.table import Table

from talaria.calibration.cache import describe_line


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f}"


def _ktok(n: float) -> str:
    return f"{n / 1e3:,.0f}K"


def _title(results: Mapping[str, Any]) -> str:
    wl = results["workload"]
    return (
        f"{results['substrate']} replay on {results['hardware']}: {wl['sessions']} sessions, "
        f"{wl['calls']} calls"
    )


def _table(title: str, columns: Sequence[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    return table


def _ratio(p: Mapping[str, Any], key: str) -> str:
    value = p.get(key)
    return "" if value is None else f"{value:.2f}"


def _with_interval(p: Mapping[str, Any], key: str) -> str:
    """``p[key]``, with the half-width of its 95% interval when the entry has one (a
    comparison over seeds: a t-interval, symmetric)."""
    value = f"{p[key]:.1f}"
    low, high = p.get(f"{key}_ci95") or (None, None)
    return value if low is None or high is None else f"{value} ±{(high - low) / 2:.0f}"


def _vs_talaria(p: Mapping[str, Any], q: str) -> str:
    """The paired ratio of a policy's SCT to talaria's over the seeds, with its interval."""
    ratio = (p.get("vs_talaria") or {}).get(q)
    if not ratio:
        return ""
    low, high = ratio["ci95"]
    interval = "" if low is None or high is None else f" [{low:.2f},{high:.2f}]"
    return f"{ratio['value']:.2f}{interval}"


def policy_table(results: Mapping[str, Any], title: str | None = None) -> Table:
    """Session completion time per policy: percentiles (over seeds: the mean and its 95%
    interval), the paired ratio to talaria (this policy's SCT over talaria's, seed by seed:
    above 1, talaria is faster), distance to the model-serial reference (SCT over the
    reference's), TTFT p95. References come last, in italics, marked
    "(ref)" ("(ref, sim)" where they were simulated beside measured runs): yardsticks, not
    policies."""
    seeds = results.get("seeds")
    caption = (
        f"{len(seeds)} seeds: mean ±half the 95% interval; ratios: geometric mean (interval)"
        if seeds and len(seeds) > 1
        else None
    )
    table = _table(
        title or _title(results),
        [
            "policy",
            "SCT p50 s",
            "SCT p95 s",
            "/talaria p50",
            "/talaria p95",
            "/serial p50",
            "TTFT p95 s",
        ],
    )
    if caption:
        table.caption, table.caption_justify = caption, "left"
    for column in table.columns:
        column.no_wrap = True
    rows = sorted(results["policies"].items(), key=lambda kv: bool(kv[1].get("reference")))
    for name, p in rows:
        ref = bool(p.get("reference"))
        table.add_row(
            (f"{name} (ref, sim)" if p.get("simulated") else f"{name} (ref)") if ref else name,
            _with_interval(p, "sct_p50_s"),
            _with_interval(p, "sct_p95_s"),
            _vs_talaria(p, "p50"),
            _vs_talaria(p, "p95"),
            _ratio(p, "sct_p50_over_model-serial"),
            f"{p['ttft_p95_s']:.2f}",
            style="italic dim" if ref else None,
        )
    return table


def comparison_table(results: Mapping[str, Any]) -> Table:
    """The headline: talaria against the best tuned per-request baseline, ``round`` and
    the model-serial reference, at p50 and p95, as paired ratios over the seeds (the other
    side's SCT over talaria's: above 1, talaria is faster; the interval says how sure)."""
    table = _table(
        f"talaria against the tuned baselines ({results['workload'].get('part', 'all')} part)",
        ["against", "p50: their SCT / talaria's", "p95: their SCT / talaria's"],
    )
    comp = results.get("comparison", {})

    def cell(key: str) -> str:
        entry = comp.get(key)
        if not entry:
            return ""
        r = entry["ratio"]
        low, high = r["ci95"]
        interval = "" if low is None else f" [{low:.2f},{high:.2f}]"
        who = f"{entry['policy']}: " if "policy" in entry else ""
        return f"{who}{r['value']:.2f}{interval}"

    for label, key in (
        ("best per-request baseline", "best_per_request"),
        ("round (paper baseline)", "round"),
        ("model-serial (reference)", "model-serial"),
    ):
        table.add_row(label, cell(f"{key}_p50"), cell(f"{key}_p95"))
    return table


def tuning_table(doc: Mapping[str, Any]) -> Table:
    """Each policy's tuned knobs and their tune-part scores (mean over the tune seeds), with
    the spread over the settings tried (how much the knobs matter)."""
    table = _table(
        f"tuned on the tune part, seeds {doc.get('seeds')}",
        ["policy", "knobs", "SCT p50 s", "SCT p95 s", "p50 over the grid s"],
    )
    for name, t in doc["policies"].items():
        chosen = next(x for x in t["trials"] if x["knobs"] == t["knobs"])
        p50s = [x["mean_sct_p50_s"] for x in t["trials"]]
        knobs = ", ".join(f"{k}={v:g}" for k, v in t["knobs"].items())
        table.add_row(
            name,
            knobs,
            f"{chosen['mean_sct_p50_s']:.1f}",
            f"{chosen['mean_sct_p95_s']:.1f}",
            f"{min(p50s):.0f}-{max(p50s):.0f} ({len(p50s)} settings)",
        )
    return table


def calibration_line(results: Mapping[str, Any]) -> str | None:
    """Which ``cpu`` profile priced the prediction ("measured here", cached or just now, or
    "shipped profile"), when and under which key; None for a document without one. A
    replay off the CPU calibrates nothing: its entry names the shipped profile it used."""
    entry = results.get("calibration")
    if not isinstance(entry, Mapping):
        return None
    return describe_line(entry) if "origin" in entry else str(entry.get("profile"))


def fidelity_table(results: Mapping[str, Any]) -> Table:
    """Simulator fidelity: the simulator's predicted SCT against the measured one, per
    policy, with the relative error (predicted - measured) / measured, and where the
    profile's steps were priced by a step grid, the error of the roofline it replaced on the
    same run (``roofline``); the caption names the calibration that priced the prediction
    (:func:`calibration_line`)."""
    hardware = results.get("hardware", "cpu")
    fidelity = results.get("fidelity", {})
    roofline = any("roofline_error_sct_p50_s" in f for f in fidelity.values())
    columns = ["policy", "SCT p50 s", "predicted", "error", "SCT p95 s", "predicted", "error"]
    if roofline:
        columns += ["roofline p50", "roofline p95"]
    table = _table(f"simulator fidelity ({hardware} profile vs the real engine)", columns)
    line = calibration_line(results)
    if line is not None:
        table.caption = f"{hardware} profile: {line}"
        table.caption_justify = "left"
    for name, f in fidelity.items():
        row = [name]
        for key in ("sct_p50_s", "sct_p95_s"):
            row += [
                f"{f[f'measured_{key}']:.1f}",
                f"{f[f'predicted_{key}']:.1f}",
                f"{100 * f[f'error_{key}']:+.0f}%",
            ]
        if roofline:
            row += [
                f"{100 * f[f'roofline_error_{key}']:+.0f}%" if f"roofline_error_{key}" in f else "-"
                for key in ("sct_p50_s", "sct_p95_s")
            ]
        table.add_row(*row)
    return table


def step_cost_table(results: Mapping[str, Any]) -> Table:
    """Where the prediction's error comes from: each kind of executed step (prefill,
    decode, switch, stage, KV moves alone) with its count, the seconds measured and the
    seconds the profile predicts for the same steps, per policy, and the CPU time the event
    loop's thread used while they ran (its Python work holds the GIL the steps' ops need)."""
    table = _table(
        "step costs (the same steps measured and priced)",
        ["policy", "kind", "steps", "measured s", "predicted s", "error", "loop CPU s"],
    )
    for name, kinds in results.get("step_costs", {}).items():
        for kind, row in kinds.items():
            m, p = row["measured_s"], row["predicted_s"]
            error = f"{100 * (p - m) / m:+.0f}%" if m else "-"
            loop = f"{row['loop_cpu_s']:.1f}" if "loop_cpu_s" in row else "-"
            table.add_row(name, kind, str(row["count"]), f"{m:.1f}", f"{p:.1f}", error, loop)
    return table


def mechanism_table(results: Mapping[str, Any]) -> Table:
    """What each mechanism did: prefix tokens reused / restored / recomputed, bytes moved,
    model switches (staged ones), session-prefill admissions, reservations."""
    table = _table(
        "mechanisms",
        [
            "policy",
            "reused tok",
            "restored tok",
            "recomputed tok",
            "moved GB",
            "switches",
            "staged",
            "SP admits",
            "reservations",
        ],
    )
    for name, p in results["policies"].items():
        table.add_row(
            name,
            _ktok(p["prefix_reused_tokens"]),
            _ktok(p["restored_tokens"]),
            _ktok(p["recomputed_tokens"]),
            _gb(p["bytes_moved"]),
            str(p["model_switches"]),
            str(p["staged_switches"]),
            str(p["sp_admissions"]),
            str(p["reservations_made"]),
        )
    return table


def plot_sct_cdf(results: Mapping[str, Any], path: Path) -> Path:
    """Every policy's SCT CDF in one PNG."""
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for name, p in results["policies"].items():
        xs = sorted(p["session_sct_s"])
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ref = bool(p.get("reference"))
        style = ":" if ref else "--" if name.startswith("talaria-") else "-"
        width = 2.4 if name in ("talaria", "round") else 1.6 if ref else 1.2
        label = (
            name if not ref else f"{name} (reference{', simulated' if p.get('simulated') else ''})"
        )
        color = "black" if name == "model-serial" else "grey" if ref else None
        ax.step(xs, ys, where="post", label=label, linestyle=style, linewidth=width, color=color)
    wl = results["workload"]
    ax.set_xlabel("session completion time (s)")
    ax.set_ylabel("fraction of sessions")
    ax.set_title(
        f"SCT CDF: {wl['sessions']} sessions, {wl['calls']} calls, "
        f"{results['substrate']} on {results['hardware']}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def sweep_table(rows: Sequence[Mapping[str, Any]], policies: Sequence[str]) -> Table:
    table = Table(
        title="Sensitivity: speedup of each policy's SCT over round", title_justify="left"
    )
    table.add_column("sessions", justify="right")
    table.add_column("gap scale", justify="right")
    for name in policies:
        table.add_column(f"{name} p50", justify="right")
        table.add_column(f"{name} p95", justify="right")
    for row in rows:
        cells = [str(row["sessions"]), f"{row['gap_scale']:g}x"]
        for name in policies:
            p = row["policies"][name]
            cells += [f"{p['speedup_p50_vs_round']:.2f}", f"{p['speedup_p95_vs_round']:.2f}"]
        table.add_row(*cells)
    return table


def plot_sweep(rows: Sequence[Mapping[str, Any]], policies: Sequence[str], path: Path) -> Path:
    """Two panels: speedup over round vs sessions (gap 1x) and vs gap scale (default count)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120)
    panels = (("sessions", "sessions", axes[0]), ("gap_scale", "tool-gap scale", axes[1]))
    for key, label, ax in panels:
        series = [r for r in rows if r["axis"] == key]
        xs = [r[key] for r in series]
        for name in policies:
            if name == "round":
                continue
            for q, style in (("p50", "-o"), ("p95", "--s")):
                ys = [r["policies"][name][f"speedup_{q}_vs_round"] for r in series]
                ax.plot(xs, ys, style, label=f"{name} {q}", markersize=4)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("SCT speedup over round")
        ax.grid(alpha=0.3)
    axes[1].set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    fig.suptitle("Talaria over the round baseline: sensitivity")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _effect(entry: Mapping[str, Any] | None) -> str:
    """A paired ratio as ``value [low,high]``; '' when absent."""
    if not entry:
        return ""
    low, high = entry["ci95"]
    interval = "" if low is None or high is None else f" [{low:.2f},{high:.2f}]"
    return f"{entry['value']:.2f}{interval}"


def map_table(rows: Sequence[Mapping[str, Any]], q: str = "p50") -> Table:
    """The mechanism map: for each point, each mechanism's effect (its ablation's SCT over
    talaria's, over seeds) and talaria against the best tuned per-request baseline."""
    mechs = list(rows[0]["mechanisms"]) if rows else []
    table = _table(
        f"where each mechanism pays (SCT {q}: without it / with it; above 1 it pays)",
        ["setting", *mechs, "best per-request / talaria"],
    )
    for row in rows:
        best = row["comparison"].get(f"best_per_request_{q}", {})
        cells = [_effect(row["mechanisms"][m].get(q)) for m in mechs]
        who = f"{best['policy']}: " if best else ""
        table.add_row(row["point"]["label"], *cells, who + _effect(best.get("ratio")))
    return table


def map_markdown(rows: Sequence[Mapping[str, Any]], q: str = "p50") -> str:
    """The map as a Markdown table (the same cells as :func:`map_table`)."""
    mechs = list(rows[0]["mechanisms"]) if rows else []
    head = ["setting", *mechs, "best per-request / talaria"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        best = row["comparison"].get(f"best_per_request_{q}", {})
        cells = [_effect(row["mechanisms"][m].get(q)) for m in mechs]
        who = f"{best['policy']}: " if best else ""
        lines.append(
            "| "
            + " | ".join([row["point"]["label"], *cells, who + _effect(best.get("ratio"))])
            + " |"
        )
    return "\n".join(lines) + "\n"


def plot_map(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """A heatmap of each mechanism's effect at each point (SCT p50 and p95 side by side);
    cells whose interval lies above 1 are bold, below 1 italic."""
    mechs = list(rows[0]["mechanisms"]) if rows else []
    fig, axes = plt.subplots(
        1, 2, figsize=(12, 0.45 * len(rows) + 2.2), dpi=120, sharey=True, layout="constrained"
    )
    for ax, q in zip(axes, ("p50", "p95"), strict=True):
        grid = [[row["mechanisms"][m][q]["value"] for m in mechs] for row in rows]
        image = ax.imshow(grid, cmap="RdBu", vmin=0.5, vmax=1.5, aspect="auto")
        for i, row in enumerate(rows):
            for j, m in enumerate(mechs):
                effect = row["mechanisms"][m][q]
                low, high = effect["ci95"]
                weight = "bold" if low is not None and low > 1 else "normal"
                style = "italic" if high is not None and high < 1 else "normal"
                ax.text(
                    j,
                    i,
                    f"{effect['value']:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    fontweight=weight,
                    fontstyle=style,
                )
        ax.set_xticks(range(len(mechs)), mechs, rotation=30, ha="right", fontsize=8)
        if ax is axes[0]:  # the second panel shares the first's rows
            ax.set_yticks(range(len(rows)), [r["point"]["label"] for r in rows], fontsize=8)
        ax.set_title(f"SCT {q}: without the mechanism / with it", fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.6)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def comparison_markdown(results: Mapping[str, Any]) -> str:
    """A comparison's ``results.json`` as Markdown: the workload, every policy's SCT over
    seeds (mean, 95% interval, paired ratio to talaria), its tuned knobs, and the headline
    against the best tuned per-request baseline, ``round`` and the model-serial reference."""
    wl = results["workload"]
    seeds = results.get("seeds", [wl.get("seed")])
    lines = [
        f"{results['substrate']} replay on {results['hardware']}, "
        f"{len(results.get('instances', []))} instance(s): {wl['sessions']} sessions, "
        f"{wl['calls']} calls per seed, {wl.get('part', 'all')} part, seeds {seeds}, "
        f"tool gaps x{wl.get('gap_scale', 1.0):g}, hints {'on' if wl.get('hints') else 'off'}.",
        "",
        "| policy | SCT p50 s (95% CI) | SCT p95 s (95% CI) | p50 / talaria | p95 / talaria "
        "| TTFT p95 s | knobs |",
        "|---|---|---|---|---|---|---|",
    ]

    def ci(p: Mapping[str, Any], key: str) -> str:
        low, high = p.get(f"{key}_ci95") or (None, None)
        interval = "" if low is None else f" ({low:.0f}-{high:.0f})"
        return f"{p[key]:.1f}{interval}"

    rows = sorted(results["policies"].items(), key=lambda kv: bool(kv[1].get("reference")))
    for name, p in rows:
        knobs = ", ".join(f"{k}={v:g}" for k, v in (p.get("knobs") or {}).items())
        label = f"{name} (reference)" if p.get("reference") else name
        lines.append(
            f"| {label} | {ci(p, 'sct_p50_s')} | {ci(p, 'sct_p95_s')} "
            f"| {_vs_talaria(p, 'p50')} | {_vs_talaria(p, 'p95')} | {p['ttft_p95_s']:.2f} "
            f"| {knobs} |"
        )
    comp = results.get("comparison", {})
    if comp:
        lines += ["", "| talaria against | p50: their SCT / talaria's | p95 |", "|---|---|---|"]
        for label, key in (
            ("best tuned per-request baseline", "best_per_request"),
            ("round (paper baseline)", "round"),
            ("model-serial (reference)", "model-serial"),
        ):
            cells = []
            for q in ("p50", "p95"):
                entry = comp.get(f"{key}_{q}")
                who = f"{entry['policy']}: " if entry and "policy" in entry else ""
                cells.append(who + _effect(entry["ratio"]) if entry else "")
            lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"
