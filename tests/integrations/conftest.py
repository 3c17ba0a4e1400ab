"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integrations.live_server import Served, serve_recorded


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """One live server per test module (see ``live_server.serve_recorded``)."""
    with serve_recorded() as s:
        yield s
