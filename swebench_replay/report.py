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

from talaria.cost.calibration import describe_line


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


def policy_table(results: Mapping[str, Any], title: str | None = None) -> Table:
    """Session completion time per policy: percentiles, speedup over ``round``, distance to
    the model-serial reference (SCT over the reference's), TTFT. References come last, in
    italics, marked "(ref)" ("(ref, sim)" where they were simulated beside measured runs):
    yardsticks, not policies."""
    table = _table(
        title or _title(results),
        [
            "policy",
            "SCT p50 s",
            "SCT p95 s",
            "mean s",
            "x round p50",
            "x round p95",
            "/serial p50",
            "/serial p95",
            "TTFT p50 s",
            "TTFT p95 s",
        ],
    )
    table.columns[0].no_wrap = True
    rows = sorted(results["policies"].items(), key=lambda kv: bool(kv[1].get("reference")))
    for name, p in rows:
        ref = bool(p.get("reference"))
        table.add_row(
            (f"{name} (ref, sim)" if p.get("simulated") else f"{name} (ref)") if ref else name,
            f"{p['sct_p50_s']:.1f}",
            f"{p['sct_p95_s']:.1f}",
            f"{p['sct_mean_s']:.1f}",
            f"{p.get('speedup_p50_vs_round', 0):.2f}",
            f"{p.get('speedup_p95_vs_round', 0):.2f}",
            _ratio(p, "sct_p50_over_model-serial"),
            _ratio(p, "sct_p95_over_model-serial"),
            f"{p['ttft_p50_s']:.2f}",
            f"{p['ttft_p95_s']:.2f}",
            style="italic dim" if ref else None,
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
    policy, with the relative error (predicted - measured) / measured; the caption names
    the calibration that priced the prediction (:func:`calibration_line`)."""
    hardware = results.get("hardware", "cpu")
    table = _table(
        f"simulator fidelity ({hardware} profile vs the real engine)",
        ["policy", "SCT p50 s", "predicted", "error", "SCT p95 s", "predicted", "error"],
    )
    line = calibration_line(results)
    if line is not None:
        table.caption = f"{hardware} profile: {line}"
        table.caption_justify = "left"
    for name, f in results.get("fidelity", {}).items():
        row = [name]
        for key in ("sct_p50_s", "sct_p95_s"):
            row += [
                f"{f[f'measured_{key}']:.1f}",
                f"{f[f'predicted_{key}']:.1f}",
                f"{100 * f[f'error_{key}']:+.0f}%",
            ]
        table.add_row(*row)
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
