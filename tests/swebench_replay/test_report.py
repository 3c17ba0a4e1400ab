"""Tables and plots made from results documents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from talaria.policy.baselines import policy
from talaria.swebench_replay.driver import ReplayOptions, run_replay
from talaria.swebench_replay.metrics import add_ratios
from talaria.swebench_replay.references import add_bound_ratios
from talaria.swebench_replay.report import (
    fidelity_table,
    mechanism_table,
    plot_sct_cdf,
    plot_sweep,
    policy_table,
    sweep_table,
)
from talaria.swebench_replay.setup import load_workload

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _entry(p50: float, p95: float, mean: float, scts: list[float], **kw: int) -> dict[str, Any]:
    counters = {
        "prefix_reused_tokens": 123_456,
        "restored_tokens": 7_000,
        "recomputed_tokens": 2_500,
        "bytes_moved": 3_500_000_000,
        "model_switches": 4,
        "staged_switches": 3,
        "sp_admissions": 11,
        "reservations_made": 9,
    }
    counters.update(kw)
    return {
        "sessions": len(scts),
        "calls": 10,
        "sct_p50_s": p50,
        "sct_p95_s": p95,
        "sct_mean_s": mean,
        "ttft_p50_s": 0.0456,
        "ttft_p95_s": 1.234,
        "session_sct_s": scts,
        **counters,
    }


def _doc() -> dict[str, Any]:
    policies = {
        "talaria": _entry(12.345, 40.0, 20.0, [5.0, 12.345, 40.0], model_switches=17),
        "round": _entry(24.69, 80.0, 50.0, [10.0, 24.69, 80.0]),
        "talaria-no-sp": _entry(15.0, 50.0, 30.0, [7.0, 15.0, 50.0]),
    }
    add_ratios(policies)
    return {
        "substrate": "sim",
        "hardware": "h200-tp8",
        "workload": {
            "trace": "synthetic",
            "sessions": 3,
            "calls": 10,
            "models": ["a", "b"],
            "seed": 0,
            "arrival": "all",
        },
        "policies": policies,
    }


def _text(table: Table) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


def _assert_png(path: Path) -> None:
    assert path.exists()
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == PNG_SIGNATURE


def test_policy_table_renders_each_policy() -> None:
    doc = _doc()
    text = _text(policy_table(doc))
    for name, p in doc["policies"].items():
        assert name in text
        assert f"{p['sct_p50_s']:.1f}" in text
    assert "12.3" in text and "24.7" in text
    assert "1.23" in text  # TTFT p95, two decimals
    assert "sim replay on h200-tp8: 3 sessions, 10 calls" in text


def test_policy_table_shows_intervals_and_paired_ratios_over_seeds() -> None:
    doc = _doc()
    doc["seeds"] = [0, 1, 2]
    doc["policies"]["round"]["sct_p50_s_ci95"] = [20.69, 28.69]
    ratio = {"value": 2.0, "ci95": [1.5, 2.5], "n": 3}
    doc["policies"]["round"]["vs_talaria"] = {"p50": ratio, "p95": ratio}
    text = _text(policy_table(doc))
    row = next(line for line in text.splitlines() if line.strip("│ ").startswith("round"))
    assert "24.7 ±4" in row and "2.00 [1.50,2.50]" in row
    assert "3 seeds: mean ±half the 95% interval" in text


def test_references_come_last_marked_and_simulated_ones_say_so() -> None:
    doc = _doc()
    doc["policies"]["model-serial"] = {
        **_entry(10.0, 40.0, 18.0, [4.0, 10.0, 40.0]),
        "reference": True,
    }
    doc["policies"]["isolated"] = {
        **_entry(3.0, 9.0, 5.0, [2.0, 3.0, 9.0]),
        "reference": True,
        "simulated": True,
    }
    add_bound_ratios(doc["policies"])
    lines = _text(policy_table(doc)).splitlines()
    rows = [line for line in lines if "talaria " in line or "(ref" in line]
    assert "model-serial (ref)" in rows[-2] and "isolated (ref, sim)" in rows[-1]
    talaria = next(line for line in rows if line.strip("│ ").startswith("talaria "))
    assert "1.23" in talaria  # 12.345 s over the reference's 10.0 s


def test_policy_table_custom_title_and_no_round() -> None:
    doc = _doc()
    del doc["policies"]["round"]
    text = _text(policy_table(doc, title="my title"))
    assert "my title" in text
    assert "talaria-no-sp" in text and "round" not in text


def test_mechanism_table_renders_each_policy() -> None:
    doc = _doc()
    text = _text(mechanism_table(doc))
    for name in doc["policies"]:
        assert name in text
    assert "123K" in text  # reused tokens
    assert "7K" in text  # restored
    assert "3.5" in text  # GB moved
    assert "17" in text  # talaria's model switches


def test_plot_sct_cdf_writes_png(tmp_path: Path) -> None:
    out = plot_sct_cdf(_doc(), tmp_path / "cdf.png")
    assert out == tmp_path / "cdf.png"
    _assert_png(out)


def test_plot_sct_cdf_from_a_real_replay(tmp_path: Path) -> None:
    wl = load_workload(synthetic=True, n_sessions=4, target_calls=40, seed=1)
    doc = run_replay(wl.replay, ReplayOptions((policy("talaria"), policy("round"))), wl.tool_table)
    _assert_png(plot_sct_cdf(doc, tmp_path / "sct_cdf.png"))
    text = _text(policy_table(doc)) + _text(mechanism_table(doc))
    assert "talaria" in text and "round" in text
    assert f"{doc['policies']['talaria']['sct_p50_s']:.1f}" in text


def test_plot_sct_cdf_skips_empty_policy(tmp_path: Path) -> None:
    doc = _doc()
    doc["policies"]["talaria-no-sp"]["session_sct_s"] = []
    _assert_png(plot_sct_cdf(doc, tmp_path / "cdf.png"))


def _rows() -> list[dict[str, Any]]:
    rows = []
    for axis, values in (("sessions", (10, 30)), ("gap_scale", (0.5, 1.0, 2.0))):
        for v in values:
            sessions = v if axis == "sessions" else 30
            gap = v if axis == "gap_scale" else 1.0
            policies = {
                "talaria": {"speedup_p50_vs_round": 1.5 + gap, "speedup_p95_vs_round": 2.0},
                "round": {"speedup_p50_vs_round": 1.0, "speedup_p95_vs_round": 1.0},
            }
            rows.append(
                {"axis": axis, "sessions": sessions, "gap_scale": gap, "policies": policies}
            )
    return rows


def test_plot_sweep_writes_png(tmp_path: Path) -> None:
    out = plot_sweep(_rows(), ["talaria", "round"], tmp_path / "sweep.png")
    assert out == tmp_path / "sweep.png"
    _assert_png(out)


def test_sweep_table_renders() -> None:
    text = _text(sweep_table(_rows(), ["talaria", "round"]))
    assert "talaria p50" in text and "round p95" in text
    assert "0.5x" in text and "2x" in text
    assert "3.50" in text  # talaria p50 speedup at gap 2


def test_fidelity_table_off_cpu_names_the_shipped_profile() -> None:
    """A replay on CUDA calibrates nothing: the table names its hardware profile and the
    calibration entry's profile line, not a CPU calibration."""
    results = {
        "hardware": "h200-tp8",
        "calibration": {"mode": "none", "profile": "shipped h200-tp8 (not calibrated off CPU)"},
        "fidelity": {
            "talaria": {
                "measured_sct_p50_s": 60.0,
                "predicted_sct_p50_s": 12.0,
                "error_sct_p50_s": -0.8,
                "measured_sct_p95_s": 90.0,
                "predicted_sct_p95_s": 22.5,
                "error_sct_p95_s": -0.75,
            }
        },
    }
    text = _text(fidelity_table(results))
    assert "simulator fidelity (h200-tp8 profile vs the real engine)" in text
    assert "h200-tp8 profile: shipped h200-tp8 (not calibrated off CPU)" in text
    assert "-80%" in text and "-75%" in text


def test_comparison_markdown_lists_every_policy_with_its_interval_and_knobs() -> None:
    from talaria.swebench_replay.report import comparison_markdown

    doc = _doc()
    doc["seeds"] = [0, 1]
    doc["policies"]["round"]["sct_p50_s_ci95"] = [20.0, 29.0]
    doc["policies"]["round"]["knobs"] = {"slot_max_s": 300.0}
    ratio = {"value": 2.0, "ci95": [1.5, 2.5], "n": 2}
    doc["comparison"] = {"round_p50": {"ratio": ratio}}
    text = comparison_markdown(doc)
    assert "seeds [0, 1]" in text
    row = next(line for line in text.splitlines() if line.startswith("| round |"))
    assert "24.7 (20-29)" in row and "slot_max_s=300" in row
    assert "| round (paper baseline) | 2.00 [1.50,2.50] |" in text
