"""The ``talaria`` command line: replay and sweep, their errors and their help."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from talaria.cli import main
from talaria.policy.baselines import POLICIES

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DESIGN_POLICY_KEYS = (
    "sessions",
    "calls",
    "sct_p50_s",
    "sct_p95_s",
    "sct_mean_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "prefix_reused_tokens",
    "restored_tokens",
    "recomputed_tokens",
    "bytes_moved",
    "model_switches",
    "sp_admissions",
)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tunings are cached under the test's own folder, never the user's."""
    monkeypatch.setenv("TALARIA_CACHE_DIR", str(tmp_path / "cache"))


def _flat(text: str) -> str:
    """Output with line wrapping undone."""
    return " ".join(text.split())


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == PNG_SIGNATURE


def test_replay_writes_results_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    argv = ["replay", "--synthetic", "--sessions", "4", "--calls", "40", "--jobs", "1"]
    rc = main([*argv, "--policies", "talaria,round", "--seeds", "2", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["seeds"] == [0, 1] and doc["workload"]["part"] == "test"
    # both policies were tuned on the tune part first, and run at their tuned knobs
    assert doc["tuning"]["part"] == "tune" and doc["tuning"]["seeds"] == [0, 1, 2]
    for name in ("talaria", "round"):
        assert doc["policies"][name]["knobs"] == doc["tuning"]["policies"][name]["knobs"]
        assert len(doc["policies"][name]["per_seed"]) == 2
        low, high = doc["policies"][name]["sct_p50_s_ci95"]
        assert low <= doc["policies"][name]["sct_p50_s"] <= high
    assert doc["comparison"]["round_p50"]["ratio"]["n"] == 2
    assert doc["substrate"] == "sim"
    assert doc["hardware"] == "h200-tp8"
    wl = doc["workload"]
    assert wl["sessions"] == 4
    assert wl["seed"] == 0 and wl["arrival"] == "all"
    assert set(doc["policies"]) == {
        "talaria",
        "round",
        "talaria-no-hints",
        "isolated",
        "model-serial",
    }
    assert {n for n, p in doc["policies"].items() if p.get("reference")} == {
        "isolated",
        "model-serial",
    }
    for entry in doc["policies"].values():
        assert all(k in entry for k in DESIGN_POLICY_KEYS)
        assert entry["calls"] == wl["calls"]
    assert doc["policies"]["round"]["speedup_p50_vs_round"] == 1.0
    _assert_png(out / "sct_cdf.png")
    text = _flat(capsys.readouterr().out)
    assert "talaria" in text and "round" in text
    assert "results.json" in text


def test_replay_options_reach_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc = main(
        [
            "replay",
            "--synthetic",
            "--sessions",
            "4",
            "--calls",
            "40",
            "--policies",
            "talaria-no-slot-order",
            "--seed",
            "5",
            "--arrival",
            "staggered:2",
            "--gap-scale",
            "0.5",
            "--no-hints",
            "--slot-max-s",
            "10",
            "--seeds",
            "1",
            "--jobs",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    wl = json.loads((out / "results.json").read_text())["workload"]
    assert wl["seed"] == 5
    assert wl["arrival"] == "staggered:2"
    assert wl["gap_scale"] == 0.5
    assert wl["hints"] is False
    # the quantum took effect (on a round-robin policy whose slots run their quantum out):
    # 5 switches with 10 s, 4 with 30 s on the same replay (the test part of the sessions)
    name = "talaria-no-slot-order"
    quantum_10 = json.loads((out / "results.json").read_text())["policies"][name]
    default = tmp_path / "default"
    argv = ["replay", "--synthetic", "--sessions", "4", "--calls", "40", "--policies", name]
    argv += ["--seed", "5", "--arrival", "staggered:2", "--gap-scale", "0.5", "--no-hints"]
    argv += ["--seeds", "1", "--jobs", "1", "--slot-max-s", "30"]
    assert main([*argv, "--out", str(default)]) == 0
    quantum_30 = json.loads((default / "results.json").read_text())["policies"][name]
    assert (quantum_10["model_switches"], quantum_30["model_switches"]) == (5, 4)


def test_replay_unknown_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["replay", "--synthetic", "--policies", "nope", "--out", str(tmp_path / "x")])
    assert rc == 2
    text = _flat(capsys.readouterr().out)
    assert "error" in text
    assert "unknown policy 'nope'" in text
    for name in POLICIES:
        assert name in text
    assert not (tmp_path / "x" / "results.json").exists()


def test_replay_missing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = "/nonexistent"
    rc = main(["replay", "--trace", missing, "--out", str(tmp_path / "x")])
    assert rc == 2
    text = _flat(capsys.readouterr().out)
    assert "error" in text
    assert missing in text


def test_replay_unknown_hardware(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--synthetic", "--sessions", "4", "--calls", "40", "--policies", "round"]
    rc = main([*argv, "--hardware", "a100", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "'a100'" in _flat(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("command", "phrases"),
    [
        ("replay", ("session completion time", "results.json", "--policies", "--gap-scale")),
        ("sweep", ("Sensitivity sweep", "speedup over round", "--gap-scales", "--sessions")),
    ],
)
def test_subcommand_help(
    command: str, phrases: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = _flat(capsys.readouterr().out)
    assert f"talaria {command}" in text
    for phrase in phrases:
        assert phrase in text


def test_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = _flat(capsys.readouterr().out)
    assert "replay" in text and "sweep" in text


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_sweep_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    rc = main(
        [
            "sweep",
            "--synthetic",
            "--sessions",
            "4",
            "--gap-scales",
            "1",
            "--calls-per-session",
            "8",
            "--policies",
            "talaria",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["policies"] == ["talaria", "round"]  # round is added
    rows = doc["rows"]
    assert [(r["axis"], r["sessions"], r["gap_scale"]) for r in rows] == [
        ("sessions", 4, 1.0),
        ("gap_scale", 30, 1.0),  # the gap-scale axis runs at the default 30 sessions
    ]
    for row in rows:
        assert set(row["policies"]) == {"talaria", "round"}
        assert row["calls"] > 0
        assert row["policies"]["round"]["speedup_p50_vs_round"] == 1.0
        assert "session_sct_s" not in row["policies"]["talaria"]
    _assert_png(out / "sweep.png")
    assert "sweep.json" in _flat(capsys.readouterr().out)
