"""The disk tier of model weights: one safetensors file per model, holding the flat host buffer.

A runner given :class:`WeightFiles` keeps host copies only of the models its core's weight
arena holds on host, and does the arena's ``DISK_TO_HOST`` steps for real: the model's file
is read into a fresh host buffer (:meth:`WeightFiles.read`), the plan's ``host_drops``
release theirs. Each file stores one uint8 tensor ``flat``: the model's weights in the
arena's layout and serving dtype (:func:`talaria.engine.runner.flatten_weights`), so a read
is one sequential copy, the same kind of read the calibration's ``disk_read_B_s`` times.

Writes are fsync'd, and both a write and a read end by asking the kernel to drop the file's
cached pages (``posix_fadvise(DONTNEED)``, as the calibration does), so every read comes
from the disk, not the page cache: a cold start here costs what a cold start costs. Where
the platform cannot drop them, :attr:`WeightFiles.cold_reads` is False and says so.

:class:`WeightReads` runs a runner's stage reads on a thread of its own, in chunks that
check a stop flag (a read is stopped only when its copy is dropped). Not thread-safe for
writes to one model; reads may run concurrently (the counters are locked).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Final

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from talaria.errors import ConfigError

READ_CHUNK_BYTES: Final = 16 << 20
"""Bytes read between two checks of a read's stop flag (:meth:`WeightFiles.read_into`)."""

_NICE: Final = 19  # the reading thread's scheduling priority (Linux per-thread nice)

log = logging.getLogger(__name__)

_KEY = "flat"
_HEADER_LEN = 8  # safetensors: a little-endian u64 header length, the JSON header, the data


def evict_from_page_cache(path: str) -> bool:
    """Ask the kernel to drop this file's cached pages (no root needed); False if unsupported."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


class WeightFiles:
    """A folder of flat weight files, one per model (``<model>.safetensors``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.cold_reads = hasattr(os, "posix_fadvise")
        self._lock = threading.Lock()  # the counters, updated by reads on several threads
        self.bytes_read = 0  # over every read of this object, whole or stopped
        self.reads = 0  # whole reads
        self.stopped_reads = 0  # reads stopped before the end (a cancelled background stage)

    def path(self, model: str) -> Path:
        if not model or "/" in model or model.startswith("."):
            raise ConfigError(f"{model!r} cannot name a weight file")
        return self.folder / f"{model}.safetensors"

    def has(self, model: str, nbytes: int) -> bool:
        """Whether ``model``'s file exists and holds ``nbytes`` of weights (a stat)."""
        p = self.path(model)
        return p.is_file() and p.stat().st_size >= nbytes

    def write(self, model: str, flat: torch.Tensor) -> Path:
        """Store ``flat`` (a 1-D uint8 host tensor) as ``model``'s file, durably, and out of
        the page cache. Mutates the folder only."""
        if flat.dtype != torch.uint8 or flat.dim() != 1:
            raise ConfigError(f"model {model}: weight files hold flat uint8 buffers")
        self.folder.mkdir(parents=True, exist_ok=True)
        p = self.path(model)
        tmp = p.with_suffix(".tmp")
        save_file({_KEY: flat.cpu().contiguous()}, str(tmp))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        tmp.replace(p)
        self.cold_reads = evict_from_page_cache(str(p)) and self.cold_reads
        return p

    def read(self, model: str, nbytes: int, pin: bool = False) -> torch.Tensor:
        """``model``'s flat weights, read from its file into a new host buffer (pinned when
        ``pin``), then dropped from the page cache. ``ConfigError`` if the file is missing
        or holds another size than ``nbytes``."""
        flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.read_into(model, flat)
        return flat

    def read_into(
        self, model: str, out: torch.Tensor, stopped: Callable[[], bool] | None = None
    ) -> bool:
        """Read ``model``'s flat weights into ``out`` (a contiguous uint8 host tensor of the
        model's size) in chunks of :data:`READ_CHUNK_BYTES`, checking ``stopped`` between
        them; then drop the file from the page cache. True once the whole file is read,
        False if ``stopped`` said stop first (``out`` then holds a prefix). ``ConfigError``
        as :meth:`read`. Mutates ``out`` and the read counters; safe to call from several
        threads for different ``out``."""
        nbytes = out.numel()
        if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
            raise ConfigError(f"model {model}: weights are read into flat uint8 buffers")
        p = self.path(model)
        if not p.is_file():
            raise ConfigError(f"model {model}: no weight file at {p}; write it first")
        start = self._data_offset(p, model, nbytes)
        view = out.numpy().data.cast("B")
        got = 0
        try:
            with open(p, "rb", buffering=0) as f:  # the read: sequential, into the buffer
                f.seek(start)
                while got < nbytes:
                    if stopped is not None and stopped():
                        return False
                    n = f.readinto(view[got : min(nbytes, got + READ_CHUNK_BYTES)])
                    if not n:
                        raise ConfigError(f"{p} ended after {got} of {nbytes} bytes")
                    got += n
        finally:
            self.cold_reads = evict_from_page_cache(str(p)) and self.cold_reads
            with self._lock:
                self.bytes_read += got
                self.reads += got == nbytes
                self.stopped_reads += got < nbytes
        return True

    def count_stopped(self) -> None:
        """Count a read stopped before its first byte (dropped while queued)."""
        with self._lock:
            self.stopped_reads += 1

    @staticmethod
    def _data_offset(p: Path, model: str, nbytes: int) -> int:
        """Where the ``flat`` tensor's bytes start in ``p``, checked against ``nbytes``
        (safetensors parses the header; the data is then read with plain reads)."""
        with safe_open(str(p), framework="pt") as f:
            if _KEY not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                raise ConfigError(f"{p} holds no {_KEY!r} tensor: not a talaria weight file")
            part = f.get_slice(_KEY)
            shape, dtype = part.get_shape(), part.get_dtype()
        if dtype != "U8" or shape != [nbytes]:
            raise ConfigError(f"{p} holds {dtype} {shape}, model {model} needs {nbytes} bytes")
        with open(p, "rb") as f:
            header = int.from_bytes(f.read(_HEADER_LEN), "little")
        begin = _HEADER_LEN + header
        if p.stat().st_size != begin + nbytes:
            raise ConfigError(f"{p} is {p.stat().st_size} bytes, not a header and {nbytes}")
        return begin


class WeightReads:
    """Reads of weight files into fresh host buffers on a thread of their own (at the
    lowest scheduling priority, like a stage's copy), one at a time in the order started,
    each to its end unless dropped; what a runner's stages read from disk.

    A read outlives the stage that started it: the arena counts the model's host copy from
    the stage's start, so when the stage is abandoned the read goes on, and the copy is
    there for the next stage or switch. Called from the runner's threads, never
    concurrently with each other; the reading thread touches only its buffers."""

    def __init__(self, files: WeightFiles) -> None:
        self.files = files
        self._pool: ThreadPoolExecutor | None = None  # started at the first read
        self._reads: dict[str, tuple[Future[bool], torch.Tensor, threading.Event]] = {}

    @property
    def pending(self) -> frozenset[str]:
        """Models whose read was started and has not been taken or dropped."""
        return frozenset(self._reads)

    def start(self, model: str, nbytes: int) -> tuple[torch.Tensor, Future[bool]]:
        """Queue a read of ``model``'s ``nbytes`` into a fresh buffer; returns the buffer
        and the read's future (True once the buffer is whole; another thread may wait on
        it). ``RuntimeError`` if one is pending for it."""
        if model in self._reads:
            raise RuntimeError(f"a read of {model} is already pending")
        return self.start_or_join(model, nbytes)

    def start_or_join(self, model: str, nbytes: int) -> tuple[torch.Tensor, Future[bool]]:
        """As :meth:`start`, or the buffer and future of the read of ``model`` already
        pending (an abandoned stage's, which a new stage of the model waits on)."""
        pending = self._reads.get(model)
        if pending is not None:
            return pending[1], pending[0]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-read")
        out = torch.empty(nbytes, dtype=torch.uint8)
        stop = threading.Event()
        future = self._pool.submit(self._read, model, out, stop)
        self._reads[model] = (future, out, stop)
        return out, future

    def _read(self, model: str, out: torch.Tensor, stop: threading.Event) -> bool:
        with contextlib.suppress(AttributeError, OSError):  # else at normal priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
        if stop.is_set():
            self.files.count_stopped()
            return False
        return self.files.read_into(model, out, stop.is_set)

    def take_done(self) -> dict[str, torch.Tensor]:
        """The buffers of the reads that ended whole, forgotten here; reads that failed
        are forgotten too (logged), their models read again where needed."""
        taken: dict[str, torch.Tensor] = {}
        for model, (future, out, _) in list(self._reads.items()):
            if future.done():
                del self._reads[model]
                if self._whole(model, future):
                    taken[model] = out
        return taken

    def wait(self, model: str) -> torch.Tensor | None:
        """Block until ``model``'s read ends and take its buffer (None when it did not end
        whole, or none is pending)."""
        read = self._reads.pop(model, None)
        if read is None:
            return None
        future, out, _ = read
        futures.wait([future])
        return out if self._whole(model, future) else None

    @staticmethod
    def _whole(model: str, future: Future[bool]) -> bool:
        if not whole(future):
            if not future.cancelled() and future.exception() is not None:
                log.error("reading the weights of %s failed: %r", model, future.exception())
            return False
        return True

    def drop(self, model: str) -> None:
        """Stop ``model``'s read (between chunks; not started: never) and forget it."""
        read = self._reads.pop(model, None)
        if read is not None:
            future, _, stop = read
            stop.set()
            if future.cancel():  # never started
                self.files.count_stopped()

    def drop_all(self) -> None:
        for model in list(self._reads):
            self.drop(model)


def whole(read: Future[bool]) -> bool:
    """Whether an ended read (a :meth:`WeightReads.start` future) filled its buffer."""
    return not read.cancelled() and read.exception() is None and bool(read.result())
