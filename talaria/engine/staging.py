"""Background weight staging: a low-priority thread on CPU, a side stream on CUDA.

A stage copies the first bytes of the next model's host weights into device KV blocks lent
for the purpose (:meth:`talaria.core.instance.InstanceCore._maybe_stage`). Done inline it
stalls the step that carries it; :class:`BackgroundCopy` does it on a thread of its own so
steps go on while it runs:

* the copy is plain ``memmove`` of fixed-size chunks through :mod:`ctypes` (which releases
  the GIL), not ``Tensor.copy_``: a tensor copy from a second thread would start its own
  OpenMP team and fight the forward's threads for the cores;
* the thread lowers its own scheduling priority (``nice`` 19 on Linux), so on a machine
  whose cores the forward keeps busy it copies in the gaps (Python between ops, sampling,
  the scheduler) rather than taking cores from the step;
* between chunks it checks a cancel flag: :meth:`cancel` returns once no chunk is in flight,
  so the lent blocks can be handed back to the KV pool safely;
* a stage of a model whose host copy is on disk first waits on the same thread for the
  model's weight file to be read (a ``fill``, checking the same flag; the read runs on a
  reader of its own, :class:`~talaria.engine.weight_files.WeightReads`), so a cold stage
  costs the step thread nothing either, as the simulator prices it.

On CUDA, :class:`StreamCopy` plays the same role with the same interface: the copy is queued
on a stream of its own (from pinned host memory, so it overlaps the forward's kernels on the
copy engine), an event marks its end, and whatever later touches the lent blocks (the
switch's device -> device copy, or a step reusing them after a cancel) is ordered after that
event on the runner's stream instead of blocking the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from typing import Final, TypeAlias

import torch

CHUNK_BYTES: Final = 4 << 20
"""Bytes copied between two checks of the cancel flag."""

NICE: Final = 19
"""Scheduling priority of the copy thread (Linux per-thread nice)."""

CopyRun: TypeAlias = tuple[torch.Tensor, torch.Tensor]
"""One ``(dst, src)`` pair a stage copies: as many bytes into ``dst`` as ``src`` holds."""

Fill: TypeAlias = Callable[[Callable[[], bool]], bool]
"""Work a background copy does before its runs (writing their sources), given a check that
says the copy was cancelled; returns False if it stopped on it."""


class BackgroundCopy:
    """One background copy at a time of ``(dst, src)`` runs of contiguous CPU bytes.

    Owned by one runner; :meth:`start`, :meth:`wait`, :meth:`cancel` and the properties are
    called from the runner's threads (its owner and the worker running its steps), never
    concurrently with each other. The copy thread touches only the tensors it was given.
    """

    def __init__(self) -> None:
        self.model: str | None = None
        self.blocks: tuple[int, ...] = ()
        self.copied_bytes = 0
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._error: BaseException | None = None

    @property
    def active(self) -> bool:
        """A copy was started and has been neither waited for nor cancelled."""
        return self._thread is not None

    @property
    def done(self) -> bool:
        """The started copy has finished (or there is none)."""
        return self._thread is None or not self._thread.is_alive()

    def start(
        self,
        model: str,
        blocks: Sequence[int],
        runs: Sequence[CopyRun],
        fill: Fill | None = None,
    ) -> None:
        """Copy every ``src`` into its ``dst`` (same byte count, contiguous, CPU) in the
        background, labelled ``model`` into ``blocks``; first, if given, run ``fill`` on the
        copy thread (it writes the sources: a weight file read) with the cancel check, and
        copy nothing if it returns False. Raises
        ``ValueError`` for a run it cannot copy, ``RuntimeError`` if a copy is still
        active."""
        if self.active:
            raise RuntimeError(f"a copy for {self.model} is still active")
        ptrs: list[tuple[int, int, int]] = []
        for dst, src in runs:
            n = dst.numel() * dst.element_size()
            if (
                dst.device.type != "cpu"
                or src.device.type != "cpu"
                or not dst.is_contiguous()
                or not src.is_contiguous()
                or n != src.numel() * src.element_size()
            ):
                raise ValueError("background copy runs must be equal-sized contiguous CPU bytes")
            ptrs.append((dst.data_ptr(), src.data_ptr(), n))
        self.model, self.blocks, self.copied_bytes = model, tuple(blocks), 0
        self._cancel.clear()
        self._error = None
        # keep the tensors alive while the thread reads and writes them
        self._thread = threading.Thread(
            target=self._copy, args=(ptrs, list(runs), fill), name=f"stage-{model}", daemon=True
        )
        self._thread.start()

    def _copy(self, ptrs: list[tuple[int, int, int]], _keep: object, fill: Fill | None) -> None:
        try:
            # not Linux, or not permitted: copy at normal priority
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            if fill is not None and not fill(self._cancel.is_set):
                return
            for dst, src, n in ptrs:
                for off in range(0, n, CHUNK_BYTES):
                    if self._cancel.is_set():
                        return
                    size = min(CHUNK_BYTES, n - off)
                    ctypes.memmove(dst + off, src + off, size)
                    self.copied_bytes += size
        except BaseException as exc:  # surfaced by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until the copy has finished; re-raises what the copy thread raised."""
        thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"background staging of {self.model} failed") from err

    def cancel(self) -> None:
        """Stop the copy between chunks and wait for it (what it wrote is left as is)."""
        self._cancel.set()
        thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None
        self._error = None
        self.model, self.blocks = None, ()


class StreamCopy:
    """:class:`BackgroundCopy`'s interface on a CUDA side stream (see the module docstring).

    A queued copy cannot be stopped: :meth:`cancel` and :meth:`wait` order the runner's
    current stream after the copy's event (so nothing reads or rewrites the lent blocks
    before the copy has landed) and return without waiting on the host. ``copied_bytes`` is
    what was queued. Called from the runner's threads, never concurrently.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"a stream copy needs a CUDA device, got {device}")
        if device.index is None:  # "cuda" means the current device; tensors say "cuda:N"
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=0)  # type: ignore[no-untyped-call]
        self.model: str | None = None
        self.blocks: tuple[int, ...] = ()
        self.copied_bytes = 0
        self._event: torch.cuda.Event | None = None
        self._keep: list[CopyRun] = []

    @property
    def active(self) -> bool:
        """A copy was started and has been neither waited for nor cancelled."""
        return self._event is not None

    @property
    def done(self) -> bool:
        """The started copy has landed on the device (or there is none)."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def start(
        self,
        model: str,
        blocks: Sequence[int],
        runs: Sequence[CopyRun],
        fill: Fill | None = None,
    ) -> None:
        """Queue every ``src`` (pinned host bytes) into its ``dst`` (device bytes, same
        count) on the side stream, after what the runner's stream has queued so far (the
        lent blocks may have been written by its KV moves); a ``fill`` runs first, on the
        caller's thread. ``ValueError`` for a run it cannot copy, ``RuntimeError`` if a copy
        is still active."""
        if self.active:
            raise RuntimeError(f"a copy for {self.model} is still active")
        if fill is not None:
            fill(lambda: False)
        for dst, src in runs:
            if (
                dst.device != self.device
                or src.device.type != "cpu"
                or not src.is_pinned()
                or dst.numel() * dst.element_size() != src.numel() * src.element_size()
            ):
                raise ValueError(
                    "stream copy runs must be pinned host bytes into as many device bytes"
                )
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in runs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        self.model, self.blocks = model, tuple(blocks)
        self.copied_bytes = sum(src.numel() * src.element_size() for _, src in runs)
        self._event, self._keep = event, list(runs)

    def wait(self) -> None:
        """Order the runner's stream after the copy (its later kernels see the bytes)."""
        self._after_copy()

    def cancel(self) -> None:
        """Forget the copy; the runner's stream still runs after it, so reusing the lent
        blocks never races the copy."""
        self._after_copy()
        self.model, self.blocks = None, ()

    def _after_copy(self) -> None:
        event = self._event
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        # the runs are views of the runner's KV pool and pinned host weights, which live as
        # long as the runner: dropping these references frees nothing the copy still reads
        self._event, self._keep = None, []
