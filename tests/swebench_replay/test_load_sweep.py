"""The load sweep: its figures, the doubling rate, tuning on the tune part, the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from talaria.cli import main
from talaria.errors import BadRequest, ConfigError
from talaria.policy.baselines import policy
from talaria.policy.knobs import grid
from talaria.sim.pool_catalog import pool_catalog
from talaria.swebench_replay.load_sweep import (
    LoadSetting,
    check_rates,
    doubling_rate,
    execute_all,
    pool_history,
    rate_reaching,
    tune_load,
    with_intervals,
)


def test_doubling_rate_interpolates_between_points() -> None:
    assert doubling_rate([1, 2, 3], [10, 15, 30]) == pytest.approx(2 + 5 / 15)
    assert doubling_rate([1, 2], [10, 20]) == 2
    assert doubling_rate([1, 2, 4], [10, 12, 19]) is None
    assert doubling_rate([0.5], [3.0]) is None
    with pytest.raises(BadRequest):
        doubling_rate([1, 2], [1.0])


def test_rate_reaching_a_bound_common_to_several_curves() -> None:
    assert rate_reaching([1, 2, 3], [10, 15, 30], 20) == pytest.approx(2 + 5 / 15)
    assert rate_reaching([1, 2, 3], [10, 15, 30], 15) == 2  # reached exactly at a point
    assert rate_reaching([1, 2, 3], [10, 15, 30], 31) is None  # never within the sweep
    assert rate_reaching([1, 2, 3], [20, 15, 30], 20) is None  # at the bound already
    assert rate_reaching([1, 2, 3], [10, 25, 22], 20) == pytest.approx(1 + 10 / 15)  # first
    with pytest.raises(BadRequest):
        rate_reaching([1, 2], [1.0], 2.0)


@given(
    st.lists(st.floats(1.0, 1e5), min_size=1, max_size=8),
    st.floats(1.0, 2e5),
)
def test_rate_reaching_lands_where_the_interpolated_curve_meets_the_bound(
    p95s: list[float], bound: float
) -> None:
    rates = [0.01 * (i + 1) for i in range(len(p95s))]
    r = rate_reaching(rates, p95s, bound)
    if r is None:  # the curve stays below the bound past its start, or starts at it
        assert p95s[0] >= bound or all(p < bound for p in p95s)
        return
    i = next(k for k, p in enumerate(p95s) if p >= bound)  # the first point at the bound
    assert i >= 1 and rates[i - 1] <= r <= rates[i]
    lo, hi = p95s[i - 1], p95s[i]
    assert lo + (hi - lo) * (r - rates[i - 1]) / (rates[i] - rates[i - 1]) == pytest.approx(bound)


def _point(rate: float, p95s: list[float]) -> dict[str, object]:
    seeds = [
        {
            "sct_p50_s": p / 2,
            "sct_p95_s": p,
            "goodput_sessions_per_h": 10.0,
            "slo_met_share": 1.0,
            "device_busy_s_per_session": 5.0,
            "device_held_s_per_session": 7.0,
        }
        for p in p95s
    ]
    return {"rate_per_s": rate, "sct_p95_s": sum(p95s) / len(p95s), "per_seed": seeds}


def test_intervals_over_seeds_by_hand() -> None:
    """Two seeds: the t quantile with one degree of freedom is 12.706; p95s 100 and 120 have
    mean 110 and standard deviation 14.142, so the half-width is 12.706 * 14.142 / sqrt(2)
    = 127.06. The baseline's p95 over the reference's is 2 and 3 by seed: geometric mean
    sqrt(6). Per seed, the reference doubles at rate 2 (seed 0: 100 -> 200) and never
    (seed 1: 120 -> 200)."""
    doc = {
        "talaria": {"points": [_point(1.0, [100.0, 120.0]), _point(2.0, [200.0, 200.0])]},
        "base": {"points": [_point(1.0, [200.0, 360.0]), _point(2.0, [400.0, 400.0])]},
    }
    out = with_intervals(doc)
    first = out["talaria"]["points"][0]["intervals"]["sct_p95_s"]
    assert first["value"] == pytest.approx(110.0)
    assert first["ci95"] == pytest.approx([110.0 - 127.062, 110.0 + 127.062], abs=1e-2)
    assert first["n"] == 2
    ratio = out["base"]["points"][0]["sct_p95_ratio_to_reference"]
    assert ratio["value"] == pytest.approx(6**0.5)
    assert out["talaria"]["points"][1]["sct_p95_ratio_to_reference"]["value"] == 1.0
    assert out["talaria"]["sct_p95_doubling_rate_per_seed"] == [2.0, None]
    assert out["base"]["sct_p95_doubling_rate_per_seed"] == [2.0, None]
    assert "intervals" not in doc["talaria"]["points"][0]  # the input is left as it was
    one = with_intervals({"talaria": {"points": [_point(1.0, [100.0])]}})
    assert one["talaria"]["points"][0]["intervals"]["sct_p95_s"]["ci95"] == [None, None]


@pytest.mark.parametrize("rates", [[], [0.0], [0.1, -0.1], [0.1, 0.1], [float("nan")]])
def test_bad_rates_are_refused(rates: list[float]) -> None:
    with pytest.raises(BadRequest):
        check_rates(rates)


def test_rates_sorted() -> None:
    assert check_rates([0.3, 0.01, 0.1]) == [0.01, 0.1, 0.3]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(BadRequest):
        LoadSetting(pool_catalog(12), 2, sessions=0)
    with pytest.raises(ConfigError):
        LoadSetting(pool_catalog(12), 3)
    for bad in (-1.0, float("inf"), float("nan"), "5"):
        with pytest.raises(BadRequest, match="provision_s"):
            LoadSetting(pool_catalog(12), 2, provision_s=bad)  # type: ignore[arg-type]


def test_a_provisioning_delay_reaches_the_pool_profile_with_its_source() -> None:
    assert LoadSetting(pool_catalog(12), 2).hardware() == {}
    (hw,) = LoadSetting(pool_catalog(12), 2, provision_s=30.0).hardware().values()
    assert hw.provision_s == 30.0 and hw.source_of("provision_s")


def test_each_result_is_reported_in_order_as_it_comes_in() -> None:
    told: list[tuple[int, int]] = []
    assert execute_all(abs, [-3, 1, -2], on_done=lambda d, t: told.append((d, t))) == [3, 1, 2]
    assert told == [(1, 3), (2, 3), (3, 3)]
    assert execute_all(abs, [], on_done=lambda d, t: told.append((d, t))) == []
    assert len(told) == 3
    with pytest.raises(ConfigError):
        execute_all(abs, [1], workers=0)


def test_tuning_reads_the_protocols_grid_on_the_tune_part() -> None:
    setting = LoadSetting(pool_catalog(3), 2, sessions=1)
    least = policy("least-loaded")
    told: list[tuple[int, int]] = []
    tuned = tune_load(setting, [least], 0.05, seeds=(0,), on_done=lambda d, t: told.append((d, t)))[
        "least-loaded"
    ]
    n = len(grid(least))
    assert told == [(k, n) for k in range(1, n + 1)]  # one simulation per setting and seed
    assert [t.knobs for t in tuned.trials] == list(grid(least))
    assert tuned.knobs in [t.knobs for t in tuned.trials]
    best = min(t.mean_p50_s for t in tuned.trials)
    chosen = next(t for t in tuned.trials if t.knobs == tuned.knobs)
    assert chosen.mean_p50_s <= best * 1.01


def test_load_command_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "load"
    argv = [
        "load",
        "--instances",
        "2",
        "--models",
        "3",
        "--sessions",
        "1",
        "--rates",
        "0.01,0.2",
        "--no-tune",
        "--keep-alive",
        "0",
        "--provision",
        "30",
    ]
    argv += ["--policies", "talaria,least-loaded", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "load.json").read_text())
    assert (out / "load_sct_p95.png").stat().st_size > 0
    assert doc["rates_per_s"] == [0.01, 0.2] and doc["tuning"]["tuned"] is False
    for entry in doc["policies"].values():
        assert [p["rate_per_s"] for p in entry["points"]] == [0.01, 0.2]
        for p in entry["points"]:
            assert p["sessions"] == 1 and p["sct_p95_s"] >= p["sct_p50_s"] > 0
            assert 0 <= p["slo_met_share"] <= 1 and p["device_busy_s_per_session"] > 0
            assert p["device_provisioned_s_per_session"] >= p["device_held_s_per_session"]
            assert p["device_held_s_per_session"] >= p["device_busy_s_per_session"]
            assert p["intervals"]["sct_p95_s"]["value"] == p["sct_p95_s"]
    assert doc["isolated_s"] and all(v > 0 for v in doc["isolated_s"].values())
    # no timer: least-loaded gives an instance back in every tool gap
    assert doc["keep_alive_s"] == 0.0 and doc["provision_s"] == 30.0
    assert all(p["scale_to_zero_per_h"] > 0 for p in doc["policies"]["least-loaded"]["points"])


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--rates", "0"), ("--rates", "-0.1"), ("--pattern", "weibull"), ("--provision", "-1")],
)
def test_load_command_refuses_bad_input(tmp_path: Path, flag: str, value: str) -> None:
    argv = [
        "load",
        "--instances",
        "2",
        "--models",
        "12",
        "--no-tune",
        flag,
        value,
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 2


def test_load_command_names_an_odd_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["load", "--instances", "3", "--no-tune", "--out", str(tmp_path)]) == 2
    assert "even number" in capsys.readouterr().out


def test_load_help_says_what_it_measures(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["load", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("talaria load", "--rates", "--pattern", "Zipf", "isolated", "doubles"):
        assert phrase in text


def test_a_test_run_starts_with_the_tune_parts_session_lengths_learned() -> None:
    """The pool's history for a test run is the tune part's sessions (never the test
    part's); a tune run has none."""
    from talaria.swebench_replay.open_loop import trace_sessions
    from talaria.swebench_replay.split import Part

    setting = LoadSetting(pool_catalog(12), 2)
    tune, _ = trace_sessions(None, Part.TUNE)
    test, _ = trace_sessions(None, Part.TEST)
    history = pool_history(setting, Part.TEST)
    assert history == tuple(s.n_calls for s in tune) and len(history) >= 5
    assert sorted(history) != sorted(s.n_calls for s in test)
    assert pool_history(setting, Part.TUNE) == ()
