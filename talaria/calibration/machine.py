"""Raw machine rates for the ``cpu`` hardware profile: matmul, memory copies, disk, op dispatch.

What is measured, on the process's torch threads:

- dense matmul FLOP/s in bf16 and fp32 (``2 n^3`` FLOPs per ``n x n`` matmul, median rep);
- memory bandwidth: a large tensor copy, counted as read + write traffic (STREAM-copy style),
  which the cost model uses the way it uses HBM bandwidth;
- "host <-> device" memcpy: on a CPU both tiers are RAM, so this is a copy between two
  preallocated buffers, counted as payload bytes per second;
- disk: write a temporary file (fsync'd), evict it from the page cache with
  ``posix_fadvise(DONTNEED)`` where the OS offers it (dropping all caches needs root), then
  read it back; the document records whether the eviction was available;
- per-op dispatch overhead of a tiny torch op (the engine's fixed cost per operator);
- RAM: physical memory, capped by the cgroup limit when there is one.

:class:`CpuWatch` says how much of the machine other processes used meanwhile (a busy
machine makes every rate slower than the engine will run when it is quiet).

:func:`measure_rates` returns the ``cpu_profile.json`` document (without its ``engine``
section, which :mod:`talaria.calibration.engine` measures);
:func:`talaria.cost.hardware.cpu_profile_from_dict` turns it into a profile.
``benchmarks/cpu_profile.py`` runs it with the shipped sizes and writes the shipped file;
:mod:`talaria.calibration.calibrate` runs it with smaller ones when it calibrates where Talaria
runs. Results use units in the key names (``_flop_s``, ``_B_s``, ``_s``).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import attrs
import torch

from talaria.engine.weight_files import evict_from_page_cache

SCHEMA_VERSION: Final = 1


@attrs.frozen
class RateSizes:
    """How big and how often: matmul side, timed repetitions, and MiB for the memory copy,
    the memcpy and the disk file. The defaults are the shipped profile's (under a minute on
    2 cores, mostly the disk file)."""

    matmul_n: int = 2048
    reps: int = 7
    copy_mb: int = 1024
    memcpy_mb: int = 256
    file_mb: int = 512
    directory: str | None = None  # for the disk test file (None: the temp directory)


def _median_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul(dtype: torch.dtype, n: int, reps: int) -> float:
    """Dense ``n x n @ n x n`` matmul rate in FLOP/s (2 n^3 FLOPs per product)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    seconds = _median_seconds(lambda: torch.matmul(a, b, out=out), reps)
    return 2.0 * n**3 / seconds


def measure_copy(nbytes: int, reps: int) -> float:
    """Seconds to copy ``nbytes`` between two preallocated, already-touched buffers."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    return _median_seconds(lambda: dst.copy_(src), reps)


def measure_disk(nbytes: int, directory: str | None) -> tuple[float, float, bool]:
    """Write then read a temp file; returns (write B/s, read B/s, page cache evicted)."""
    payload = os.urandom(1 << 20) * (nbytes >> 20)
    buf = bytearray(len(payload))
    fd, path = tempfile.mkstemp(prefix="talaria-disk-", dir=directory)
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - t0
        evicted = evict_from_page_cache(path)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            view = memoryview(buf)
            got = 0
            while got < len(buf):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        read_s = time.perf_counter() - t0
    finally:
        os.unlink(path)
    return len(payload) / write_s, len(payload) / read_s, evicted


def measure_op_overhead(reps: int = 20000) -> float:
    """Seconds per tiny torch op (dispatch overhead, not arithmetic)."""
    x = torch.ones(1)
    y = torch.ones(1)
    out = torch.empty(1)
    torch.add(x, y, out=out)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.add(x, y, out=out)
    return (time.perf_counter() - t0) / reps


def ram_bytes() -> int:
    """Physical memory, capped by a cgroup v2/v1 memory limit when one is set."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return int(total)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def visible_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return len(affinity(0))
    return os.cpu_count() or 1


def machine_busy_s() -> float | None:
    """CPU seconds every process on the machine has used since boot (``/proc/stat``: all
    but idle and I/O wait), None where there is no ``/proc/stat``."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
        ticks = [int(x) for x in first[1:9]]
    except (OSError, IndexError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuWatch:
    """How much of the machine's CPU time other processes took while this one measured:
    started at construction, read with :meth:`others_share`."""

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float | None, float]:
        return time.perf_counter(), machine_busy_s(), time.process_time()

    def others_share(self) -> float | None:
        """Other processes' CPU seconds over the machine's (wall seconds x CPUs) since the
        start, in [0, 1]; None where the machine's CPU time cannot be read."""
        wall0, busy0, own0 = self._start
        wall1, busy1, own1 = self._sample()
        if busy0 is None or busy1 is None or wall1 <= wall0:
            return None
        others = (busy1 - busy0) - (own1 - own0)
        return max(0.0, min(1.0, others / ((wall1 - wall0) * (os.cpu_count() or 1))))


def measure_rates(sizes: RateSizes, measured_by: str) -> dict[str, Any]:
    """Every measurement on the current torch threads; the ``cpu_profile.json`` document
    (``measured_by`` names the program, for the profile's sources)."""
    copy_bytes = sizes.copy_mb << 20
    copy_s = measure_copy(copy_bytes, reps=sizes.reps)
    memcpy_bytes = sizes.memcpy_mb << 20
    memcpy_s = measure_copy(memcpy_bytes, reps=sizes.reps)
    disk_write, disk_read, evicted = measure_disk(sizes.file_mb << 20, sizes.directory)
    measured = {
        "matmul_bf16_flop_s": measure_matmul(torch.bfloat16, sizes.matmul_n, sizes.reps),
        "matmul_fp32_flop_s": measure_matmul(torch.float32, sizes.matmul_n, sizes.reps),
        "mem_copy_traffic_B_s": 2.0 * copy_bytes / copy_s,
        "memcpy_payload_B_s": memcpy_bytes / memcpy_s,
        "disk_write_B_s": disk_write,
        "disk_read_B_s": disk_read,
        "torch_op_overhead_s": measure_op_overhead(),
        "ram_bytes": ram_bytes(),
    }
    return {
        "schema": SCHEMA_VERSION,
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "measured_by": measured_by,
        "machine": {
            "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "method": {
            "matmul_n": sizes.matmul_n,
            "reps": sizes.reps,
            "mem_copy_bytes": copy_bytes,
            "memcpy_bytes": memcpy_bytes,
            "disk_file_bytes": sizes.file_mb << 20,
            "disk_page_cache_evicted": evicted,
        },
        "measured": measured,
        "notes": [
            "mem_copy_traffic_B_s counts read + write bytes of dst.copy_(src).",
            "memcpy_payload_B_s counts payload bytes of a copy between two preallocated buffers.",
            "disk read follows posix_fadvise(DONTNEED) on the file when available; a full "
            "drop_caches needs root, so a read may still be partly served from cache.",
        ],
    }
