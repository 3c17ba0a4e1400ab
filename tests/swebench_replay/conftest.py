"""Fixtures for the trace-side tests: hand-written data files and the published traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from talaria.errors import TraceError
from talaria.swebench_replay.traces import find_traces

DATA = Path(__file__).parent / "data"


@pytest.fixture
def data_dir() -> Path:
    return DATA


@pytest.fixture
def real_traces() -> Path:
    """The published trace directory; the test is skipped where there is none."""
    try:
        path = find_traces()
    except TraceError as e:
        pytest.skip(f"published traces unavailable: {e}")
    if path is None or not path.is_dir():
        pytest.skip("published traces (shared/traces) not found")
    return path
