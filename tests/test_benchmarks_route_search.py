"""The route-search benchmark: versions of the router loaded by path, timed side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import talaria.policy.router
from benchmarks.route_search import measure, versions
from talaria.errors import BadRequest

ROUTER = Path(talaria.policy.router.__file__)


def test_another_router_file_is_timed_beside_this_one_on_the_same_calls() -> None:
    args = argparse.Namespace(
        instances=2,
        sessions=12,
        calls=3,
        repeats=2,
        prompt_tokens=64,
        policy="talaria",
        pack_slack=0.3,
        seed=0,
        compare=[f"copy={ROUTER}"],
    )
    times = measure(args)
    assert set(times) == {"this", "copy"}
    assert [len(t) for t in times.values()] == [6, 6]  # calls x repeats, each version
    assert all(t > 0 for ts in times.values() for t in ts)


@pytest.mark.parametrize(
    ("spec", "match"),
    [("copy", "want NAME=PATH"), ("this=x.py", "new NAME"), ("old=/nonexistent.py", "no such")],
)
def test_a_bad_compare_spec_is_refused(spec: str, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        versions([spec])
