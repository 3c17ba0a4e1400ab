"""Measure this machine for the simulator's ``cpu`` hardware profile.

Writes the measured rates to ``talaria/cost/cpu_profile.json`` (or ``--json PATH``), which
:func:`talaria.cost.hardware.load_cpu_profile` turns into a :class:`HardwareProfile`.

What is measured, on ``--threads`` cores (default 2):

- dense matmul FLOP/s in bf16 and fp32 (``2 n^3`` FLOPs per ``n x n`` matmul, median rep);
- memory bandwidth: a large tensor copy, counted as read + write traffic (STREAM-copy style),
  which the cost model uses the way it uses HBM bandwidth;
- "host <-> device" memcpy: on a CPU both tiers are RAM, so this is a copy between two
  preallocated buffers, counted as payload bytes per second;
- disk: write a temporary file of ``--file-mb`` MB (fsync'd), evict it from the page cache
  with ``posix_fadvise(DONTNEED)`` where the OS offers it (dropping all caches needs root),
  then read it back; the JSON records whether the eviction was available;
- per-op dispatch overhead of a tiny torch op (the engine's fixed cost per operator);
- RAM: physical memory, capped by the cgroup limit when there is one.

Runs in well under a minute. Results use units in the key names (``_flop_s``, ``_B_s``, ``_s``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

DEFAULT_JSON = Path(__file__).resolve().parents[1] / "talaria" / "cost" / "cpu_profile.json"
SCHEMA_VERSION = 1


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
        evicted = _evict_from_page_cache(path)
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


def _evict_from_page_cache(path: str) -> bool:
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


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every measurement and return the JSON document."""
    torch.set_num_threads(args.threads)
    copy_bytes = args.copy_mb << 20
    copy_s = measure_copy(copy_bytes, reps=args.reps)
    memcpy_bytes = args.memcpy_mb << 20
    memcpy_s = measure_copy(memcpy_bytes, reps=args.reps)
    disk_write, disk_read, evicted = measure_disk(args.file_mb << 20, args.dir)
    measured = {
        "matmul_bf16_flop_s": measure_matmul(torch.bfloat16, args.matmul_n, args.reps),
        "matmul_fp32_flop_s": measure_matmul(torch.float32, args.matmul_n, args.reps),
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
        "machine": {
            "cpu": _cpu_model(),
            "logical_cpus": os.cpu_count(),
            "threads": args.threads,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "method": {
            "matmul_n": args.matmul_n,
            "reps": args.reps,
            "mem_copy_bytes": copy_bytes,
            "memcpy_bytes": memcpy_bytes,
            "disk_file_bytes": args.file_mb << 20,
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


def render(doc: dict[str, Any], console: Console) -> None:
    m = doc["measured"]
    table = Table(
        title=f"cpu profile ({doc['machine']['threads']} threads, {doc['machine']['cpu']})"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("matmul bf16", f"{m['matmul_bf16_flop_s'] / 1e9:.1f} GFLOP/s")
    table.add_row("matmul fp32", f"{m['matmul_fp32_flop_s'] / 1e9:.1f} GFLOP/s")
    table.add_row("memory copy (read+write)", f"{m['mem_copy_traffic_B_s'] / 1e9:.2f} GB/s")
    table.add_row("memcpy payload", f"{m['memcpy_payload_B_s'] / 1e9:.2f} GB/s")
    table.add_row("disk write (fsync)", f"{m['disk_write_B_s'] / 1e9:.2f} GB/s")
    evicted = "evicted" if doc["method"]["disk_page_cache_evicted"] else "maybe cached"
    table.add_row(f"disk read ({evicted})", f"{m['disk_read_B_s'] / 1e9:.2f} GB/s")
    table.add_row("torch op overhead", f"{m['torch_op_overhead_s'] * 1e6:.2f} us")
    table.add_row("RAM", f"{m['ram_bytes'] / 1e9:.1f} GB")
    console.print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help="output file (default: %(default)s)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--matmul-n", type=int, default=2048, help="matmul side (default: %(default)s)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (default: %(default)s)")
    p.add_argument(
        "--copy-mb", type=int, default=1024, help="memory copy MiB (default: %(default)s)"
    )
    p.add_argument("--memcpy-mb", type=int, default=256, help="memcpy MiB (default: %(default)s)")
    p.add_argument("--file-mb", type=int, default=512, help="disk file MiB (default: %(default)s)")
    p.add_argument("--dir", default=None, help="directory for the disk test file (default: tmp)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console()
    t0 = time.perf_counter()
    doc = run(args)
    render(doc, console)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    console.print(f"wrote {args.json} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
