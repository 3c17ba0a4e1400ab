"""Fixtures for the trace-side tests: hand-written data files and the published traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from talaria.swebench_replay.traces import BUNDLED_TRACES

DATA = Path(__file__).parent / "data"


@pytest.fixture
def data_dir() -> Path:
    return DATA


@pytest.fixture
def real_traces() -> Path:
    """The real traces bundled with the package."""
    return BUNDLED_TRACES
