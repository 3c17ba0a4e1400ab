"""The serverless pool in miniature, live on this machine, beside the simulator's prediction.

4 embedded-engine instances in this process, 8 small models (Zipf popularity), open-loop
Poisson arrivals of real trace sessions (tokens x0.02, tool gaps x0.1), weights past each
instance's 0.99 GB host budget loaded from their files on disk for real
(:mod:`talaria.swebench_replay.live_pool`). Writes ``live_pool.json`` and prints, per
policy, the measured figures, the simulator's and its error.

    python benchmarks/live_pool.py --out runs/live-pool   # 7 min here; 13 more to calibrate
    python benchmarks/live_pool.py --sessions 24 --rate 0.2 --policies talaria
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from talaria.calibration.cache import CalibrationMode
from talaria.policy.baselines import parse_policies
from talaria.swebench_replay.live_pool import LivePool, run_live_pool
from talaria.swebench_replay.live_replay import ReplayHooks

ROWS = (
    ("SCT p50 s", "sct_p50_s"),
    ("SCT p95 s", "sct_p95_s"),
    ("TTFT p95 s", "ttft_p95_s"),
    ("cold loads", "cold_loads"),
    ("model switches", "model_switches"),
    ("scale to zero", "scale_to_zero"),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--sessions", type=int, default=16, help="arrivals (default 16)")
    p.add_argument("--rate", type=float, default=0.1, help="arrivals per second (default 0.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="talaria,serverless")
    p.add_argument(
        "--keep-alive",
        type=float,
        default=math.inf,
        help="seconds an idle instance stays provisioned before it scales to zero (default: never)",
    )
    p.add_argument("--calibration", default="auto", choices=[m.value for m in CalibrationMode])
    p.add_argument("--disk", type=Path, default=None, help="weight files (default: a temp dir)")
    p.add_argument("--out", type=Path, default=Path("runs/live-pool"))
    args = p.parse_args(argv)
    console = Console()
    pool = LivePool(
        tuple(attrs.evolve(p, keep_alive_s=args.keep_alive) for p in parse_policies(args.policies)),
        instances=args.instances,
        sessions=args.sessions,
        rate_per_s=args.rate,
        seed=args.seed,
        calibration=CalibrationMode(args.calibration),
    )
    hooks = ReplayHooks(status=lambda line: console.print(f"[dim]{line}[/dim]"))
    with tempfile.TemporaryDirectory(prefix="talaria-weights-") as tmp:
        doc = run_live_pool(pool, args.disk or Path(tmp), hooks)
    doc["command"] = "python benchmarks/live_pool.py " + shlex.join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "live_pool.json").write_text(json.dumps(doc, indent=1) + "\n")
    console.print(table(doc))
    console.print(f"wrote {args.out / 'live_pool.json'} in {doc['wall_s']:.0f} s")
    return 0


def table(doc: dict[str, Any]) -> Table:
    t = Table(title="live pool: measured / simulated (error)")
    t.add_column("figure")
    for name in doc["policies"]:
        t.add_column(name, justify="right")
    for label, key in ROWS:
        cells = []
        for entry in doc["policies"].values():
            m, s = entry["measured"][key], entry["predicted"][key]
            err = f" ({(s - m) / m:+.0%})" if m else ""
            cells.append(f"{m:.3g} / {s:.3g}{err}")
        t.add_row(label, *cells)
    return t


if __name__ == "__main__":
    sys.exit(main())
