"""A short soak of ``talaria serve``: sessions with tool gaps (hinted or not), streams the
client abandons, sessions that never send ``end``. No answer lost, every quiet session
expired, every invariant intact, descriptors back to where they started and memory flat.
The long version (30 minutes, gaps up to 10 minutes) is ``benchmarks/soak.py``; its figures
are in docs/reliability.md."""

from __future__ import annotations

import pytest

from benchmarks.soak import (
    MAX_RSS_SLOPE_MIB_MIN,
    MIN_TREND_WINDOW_S,
    Sample,
    SoakReport,
    rss_slope_mib_min,
    run,
)
from tests.reliability.inprocess import requires_tiny_model

pytestmark = requires_tiny_model

MiB = 2**20


def check(rep: SoakReport) -> None:
    assert rep.errors == () and rep.lost == 0
    assert rep.abandoned > 0 and rep.expired_quietly > 0 and rep.ended > 0 and rep.hints > 0
    assert rep.sessions_left == 0  # the quiet ones expired
    assert rep.integrity == "ok"
    assert rep.fds_end <= rep.fds_idle_start
    assert rep.rss_growth_bytes < 64 * MiB
    if rep.trend_judged:
        assert rep.rss_slope_last_third_mib_min < MAX_RSS_SLOPE_MIB_MIN
    assert rep.ok


def test_a_short_soak_leaves_the_server_as_it_found_it() -> None:
    rep = run(minutes=0.5, max_gap_s=4.0, session_idle_s=3.0, rate_per_s=4.0, sample_s=2.0)
    # 15 s is too short for a trend (one arena taken reads as MiB per minute): growth and
    # descriptors judge it
    assert not rep.trend_judged
    check(rep)


def test_the_trend_is_judged_only_over_a_long_enough_window() -> None:
    def report(last_third_s: float, slope: float) -> SoakReport:
        return SoakReport(
            minutes=1.0, max_gap_s=1.0, session_idle_s=1.0, sessions=1, answered=1, lost=0,
            abandoned=0, hints=0, ended=1, expired_quietly=0, sessions_left=0,
            integrity="ok", rss_steady_bytes=0, rss_end_bytes=0, rss_peak_bytes=0,
            fds_idle_start=10, fds_steady=10, fds_end=10, fds_peak=10, threads_end=1,
            errors=(), rss_slope_last_third_mib_min=slope, last_third_s=last_third_s,
        )  # fmt: skip

    assert report(MIN_TREND_WINDOW_S - 1, 5.0).ok
    assert not report(MIN_TREND_WINDOW_S, MAX_RSS_SLOPE_MIB_MIN).ok
    assert report(MIN_TREND_WINDOW_S, MAX_RSS_SLOPE_MIB_MIN / 2).ok


@pytest.mark.slow
def test_a_ten_minute_soak() -> None:
    check(run(minutes=10, max_gap_s=120.0, session_idle_s=60.0, rate_per_s=2.0))


def test_the_memory_trend_is_a_least_squares_slope_over_the_window() -> None:
    def at(t_s: float, mib: float) -> Sample:
        return Sample(t_s, int(mib * MiB), 10, 4, 0.0)

    # 2 MiB per minute, with a noisy reading that endpoints alone would take for a trend
    samples = [at(60.0 * k, 100.0 + 2.0 * k + (5.0 if k == 7 else 0.0)) for k in range(10)]
    assert rss_slope_mib_min(samples, 0.0, 600.0) == pytest.approx(
        2.0 + 5.0 * (7 - 4.5) / 82.5, rel=1e-9
    )
    flat = [at(60.0 * k, 100.0) for k in range(10)]
    assert rss_slope_mib_min(flat, 0.0, 600.0) == pytest.approx(0.0, abs=1e-9)
    assert rss_slope_mib_min(samples, 0.0, 60.0) == 0.0  # two samples: no trend
