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

A read may run on a runner's background stage thread (:class:`~talaria.engine.staging.
BackgroundCopy`), in chunks, stopping between them when the stage is cancelled. Not
thread-safe for writes to one model; reads may run concurrently (the counters are locked).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from talaria.errors import ConfigError

READ_CHUNK_BYTES: Final = 16 << 20
"""Bytes read between two checks of a read's stop flag (:meth:`WeightFiles.read_into`)."""

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
