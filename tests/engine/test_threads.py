"""in_own_thread: the value or the exception comes back, the thread is gone, and it ran
torch's thread count of the caller."""

from __future__ import annotations

import threading

import pytest
import torch

from talaria.engine.threads import in_own_thread


def test_the_value_comes_back_from_a_thread_that_is_gone() -> None:
    caller = threading.get_ident()
    seen: list[threading.Thread] = []

    def work() -> tuple[int, int]:
        seen.append(threading.current_thread())
        return threading.get_ident(), torch.get_num_threads()

    ident, threads = in_own_thread(work)
    assert ident != caller and threads == torch.get_num_threads()
    assert not seen[0].is_alive()


def test_the_exception_is_raised_on_the_caller() -> None:
    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        in_own_thread(fail)
