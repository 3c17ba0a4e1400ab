"""Gates for the tests that show hint delivery never holds up the agent.

The test holds delivery back at a gate only it opens, runs the agent-facing calls on a
thread, and checks they returned while the gate was still closed. Calls that waited for
delivery would never return; :data:`LIVENESS_S` turns that into a failure with a clear
message instead of a hung test. It is a liveness bound, never a measure of speed: on a
healthy machine the calls return at once, however loaded it is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from talaria.session import HintEvent, HintSink

__all__ = ["BACKSTOP_S", "LIVENESS_S", "GatedSink", "returns_while_held"]

LIVENESS_S = 30.0
BACKSTOP_S = 120.0  # a gate a failed test never opened lets its thread go after this long
_T = TypeVar("_T")


class GatedSink:
    """A :class:`~talaria.session.HintSink` that holds each delivery until ``open`` is set,
    then hands it to ``inner`` (a real sink: its successes and failures are counted as
    usual). ``entered`` is set once a delivery is waiting at the gate."""

    def __init__(self, inner: HintSink) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.entered = threading.Event()

    def deliver(self, event: HintEvent) -> None:
        self.entered.set()
        if not self.open.wait(BACKSTOP_S):
            raise TimeoutError("the test never opened the gate")
        self.inner.deliver(event)

    def close(self) -> None:
        self.inner.close()


def returns_while_held(fn: Callable[[], _T], what: str, gate: threading.Event | None = None) -> _T:
    """``fn()``, run on a thread while ``gate`` (if given) stays closed; the test fails if it
    has not returned within :data:`LIVENESS_S` (then ``gate`` is opened, to free it)."""
    if gate is not None:
        assert not gate.is_set(), "the gate must be closed while the agent-facing calls run"
    results: list[_T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(fn())
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, name="agent", daemon=True)
    thread.start()
    thread.join(LIVENESS_S)
    if thread.is_alive():
        if gate is not None:
            gate.set()
        pytest.fail(
            f"{what} did not return within {LIVENESS_S:g} s while hint delivery was held "
            "back at a gate: it waits for delivery",
            pytrace=False,
        )
    if errors:
        raise errors[0]
    return results[0]
