"""The substrate protocol, where the layout of docs/design.md puts it.

The protocol itself is :class:`talaria.runtime.substrate.Substrate`: the three phases the
live loop calls (``plan`` on the event loop, ``execute`` on a worker thread, ``commit`` on the
event loop), ``prepare`` to announce a call, and its outputs. It lives beside the loop that
calls it so that the runtime never imports a backend; backends implement it structurally
(the embedded engine's :class:`~talaria.engine.runner.EngineRunner`; vLLM engines next).
The simulator executes the same decisions in virtual time, driving the core directly.
"""

from __future__ import annotations

from talaria.runtime.substrate import Substrate

__all__ = ["Substrate"]
