"""Load over a real socket against ``talaria serve`` (tiny random-weight model, small memory
budgets): every answer arrives once, in its own session, equal to the same messages answered
alone, and from a session's second call on its prefix is cached. The default suite runs 100
concurrent sessions; the slow one the full 1,000 (``benchmarks/load.py`` writes the figures)."""

from __future__ import annotations

import pytest

from benchmarks.load import LoadReport, measure
from tests.reliability.inprocess import requires_tiny_model

pytestmark = requires_tiny_model


def check(rep: LoadReport, sessions: int, calls: int) -> None:
    assert rep.errors == ()
    assert (rep.answered, rep.lost) == (sessions * calls, 0)
    assert rep.crossed == 0  # each answer equal to the same messages answered alone
    assert rep.wrong_session == 0 and rep.not_once == 0
    assert rep.uncached_continuations == 0
    assert rep.ends_refused == 0
    assert rep.open_fds_after is not None and rep.open_fds_after < 50  # the sockets closed
    assert rep.ok


def test_100_concurrent_sessions_of_3_calls() -> None:
    check(measure(100, 3, None, 8), 100, 3)


@pytest.mark.slow
def test_1000_concurrent_sessions_of_3_calls() -> None:
    check(measure(1000, 3, None, 8), 1000, 3)
