"""Why a forward runs slower on a worker thread: whose OpenMP team is alive.

Each thread that runs a parallel torch op on a CPU gets an OpenMP team of its own (libgomp
keeps the team's helper threads until that thread exits). With more OpenMP threads alive
than cores, libgomp throttles its spin-waiting, and every parallel region then wakes its
team. The live runtime executes steps on a worker thread; this benchmark times the same
forwards (a stack of matmuls shaped like SmolLM2-135M's MLPs) in four processes:

* ``main``: on the main thread, nothing else ran torch;
* ``worker_after_main``: on a worker thread after the main thread ran one forward (as a
  process that loads and warms its models on the main thread, then serves from a worker);
* ``worker_only``: on a worker thread, the main thread never ran a parallel op;
* ``worker_after_worker``: on a worker thread after another worker thread ran one forward
  and exited (its team went with it).

Each mode runs in a fresh process, modes interleaved over ``--rounds``; the median of each
is reported. ``python benchmarks/omp_teams.py --json benchmarks/results/omp_teams.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

MODES = ("main", "worker_after_main", "worker_only", "worker_after_worker")
ROWS = (1, 8, 256)  # a decode step of 1 and of 8 sequences, a 256-token prefill chunk


def _forwards(threads: int) -> dict[int, float]:
    """Median milliseconds of one forward per row count (runs on the calling thread)."""
    import torch

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    up = [torch.randn(576, 1536, generator=gen) for _ in range(30)]
    down = [torch.randn(1536, 576, generator=gen) for _ in range(30)]

    def forward(rows: int) -> None:
        x = torch.randn(rows, 576, generator=gen)
        with torch.inference_mode():
            for a, b in zip(up, down, strict=True):
                x = torch.nn.functional.silu(x @ a) @ b
                x = x / (x.norm(dim=-1, keepdim=True) + 1)

    out = {}
    for rows in ROWS:
        for _ in range(3):
            forward(rows)
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            forward(rows)
            times.append(time.perf_counter() - t0)
        out[rows] = statistics.median(times) * 1e3
    return out


def _on_thread(fn: Callable[[], dict[int, float]]) -> dict[int, float]:
    result: list[dict[int, float]] = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    worker.join()
    return result[0]


def one_mode(mode: str, threads: int) -> dict[int, float]:
    """Time the forwards as ``mode`` says (in this process: call it in a fresh one)."""
    if mode == "main":
        return _forwards(threads)
    if mode == "worker_after_main":
        _forwards_once(threads)
        return _on_thread(lambda: _forwards(threads))
    if mode == "worker_only":
        return _on_thread(lambda: _forwards(threads))
    if mode == "worker_after_worker":
        _on_thread(lambda: _forwards_once(threads))
        return _on_thread(lambda: _forwards(threads))
    raise SystemExit(f"unknown mode {mode!r}; one of {MODES}")


def _forwards_once(threads: int) -> dict[int, float]:
    import torch

    torch.set_num_threads(threads)
    x = torch.randn(8, 576)
    with torch.inference_mode():
        (x @ torch.randn(576, 1536)).sum()
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per mode")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--json", type=Path, help="write the medians here")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(one_mode(args.mode, args.threads)))
        return
    if args.rounds < 1 or args.threads < 1:
        raise SystemExit("--rounds and --threads must be at least 1")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--mode", mode, "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[mode].append(json.loads(out))
    medians = {
        mode: {str(r): statistics.median(run[str(r)] for run in runs[mode]) for r in ROWS}
        for mode in MODES
    }
    print(f"median ms of one forward ({args.threads} torch threads, {args.rounds} processes)")
    print(f"{'mode':<22}" + "".join(f"{f'{r} rows':>10}" for r in ROWS))
    for mode, ms in medians.items():
        print(f"{mode:<22}" + "".join(f"{ms[str(r)]:>10.2f}" for r in ROWS))
    if args.json is not None:
        doc = {"threads": args.threads, "rounds": args.rounds, "median_ms": medians}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
