"""A short soak of ``talaria serve``: sessions with tool gaps (hinted or not), streams the
client abandons, sessions that never send ``end``. No answer lost, every quiet session
expired, every invariant intact, descriptors back to where they started and memory flat.
The long version (30 minutes, gaps up to 10 minutes) is ``benchmarks/soak.py``; its figures
are in docs/reliability.md."""

from __future__ import annotations

import pytest

from benchmarks.soak import MAX_RSS_SLOPE_MIB_MIN, Sample, SoakReport, rss_slope_mib_min, run
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
    assert rep.rss_slope_last_third_mib_min < MAX_RSS_SLOPE_MIB_MIN
    assert rep.ok


def test_a_short_soak_leaves_the_server_as_it_found_it() -> None:
    check(run(minutes=0.75, max_gap_s=4.0, session_idle_s=3.0, rate_per_s=4.0, sample_s=2.0))


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
