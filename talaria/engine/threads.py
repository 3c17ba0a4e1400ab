"""Which thread runs torch on a CPU: one OpenMP team alive while steps run.

Each thread that runs a parallel torch op on a CPU gets an OpenMP team of its own, and
libgomp keeps the team's helper threads until that thread exits. With more OpenMP threads
alive than cores, libgomp throttles its spin-waiting and every parallel region wakes its
team: a decode step of SmolLM2's shape on a worker thread takes 18.9 ms after the main
thread ran one parallel op, 9.6-11.4 ms otherwise (``benchmarks/omp_teams.py``, two cores).

So the serving steps run on a worker thread, and every other piece of torch work of the
process (loading weights, building an engine, a warm-up call, a calibration's probes) runs
through :func:`in_own_thread`: on a thread that exits when it is done, its team with it.
The thread that calls it (the main thread, the event loop's) never runs torch itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["in_own_thread"]

T = TypeVar("T")


def in_own_thread(fn: Callable[[], T], name: str = "talaria-torch") -> T:
    """``fn()`` on a fresh thread running torch's current thread count; blocks until it
    returns, re-raises its exception here. The thread exits at once, so its OpenMP team
    does not outlive the work (see the module docstring)."""
    threads = torch.get_num_threads()
    out: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        torch.set_num_threads(threads)
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            failed.append(exc)

    worker = threading.Thread(target=run, name=name)
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return out[0]
