"""Measure this machine for the simulator's shipped ``cpu`` hardware profile.

Writes the measured rates to ``talaria/cost/cpu_profile.json`` (or ``--json PATH``), which
:func:`talaria.cost.hardware.load_cpu_profile` turns into a :class:`HardwareProfile`. The
measurements are the library's (:mod:`talaria.calibration.machine`, which the
calibration ``talaria replay --substrate embedded`` makes where it runs also uses), on
``--threads`` cores (default 2): dense matmul FLOP/s in bf16 and fp32, a large tensor copy
(read + write traffic), a memcpy between preallocated buffers (payload), a disk file written
(fsync'd), evicted from the page cache where the OS allows and read back, the dispatch
overhead of a tiny torch op, and RAM (capped by the cgroup limit).

Runs in well under a minute. Results use units in the key names (``_flop_s``, ``_B_s``, ``_s``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from talaria.calibration.machine import RateSizes, measure_rates

DEFAULT_JSON = Path(__file__).resolve().parents[1] / "talaria" / "cost" / "cpu_profile.json"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every measurement and return the JSON document."""
    torch.set_num_threads(args.threads)
    sizes = RateSizes(
        matmul_n=args.matmul_n,
        reps=args.reps,
        copy_mb=args.copy_mb,
        memcpy_mb=args.memcpy_mb,
        file_mb=args.file_mb,
        directory=args.dir,
    )
    return measure_rates(sizes, "benchmarks/cpu_profile.py")


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
