"""Calibrate the simulator's ``cpu`` profile from engine microbenchmarks.

The simulator prices a step as ``max(FLOPs / flop rate, bytes read / bandwidth) + a fixed
overhead``. Raw machine rates (``benchmarks/cpu_profile.py``: a square matmul, a memcpy) are
upper bounds the engine does not reach, so this script measures the embedded engine itself
through its serving path (``EngineRunner.step``: schedule, execute, commit) on each catalog
model of the embedded replay, and fits the three numbers:

- decode: the time of a batch-1 decode step on a short context, per model, fitted as
  ``overhead + weight_bytes / bandwidth`` (least squares over the models);
- prefill: a 1,024-token prefill per model, fitted as ``overhead + FLOPs / flop rate``
  with the overhead from the decode fit;

and writes them as the ``engine`` section of ``talaria/sim/cpu_profile.json`` (``--json``),
which :func:`talaria.sim.hardware.cpu_profile_from_dict` prefers to the raw rates. Nothing
here reads replay results. About 3 minutes on 2 cores (loading the models is most of it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from talaria.backends.embedded import build_embedded
from talaria.config import InstanceSpec
from talaria.policy.baselines import POLICIES
from talaria.types import Call, TokenSeq

DEFAULT_JSON = Path(__file__).resolve().parents[1] / "talaria" / "sim" / "cpu_profile.json"
MODELS = ("smollm2-135m", "qwen2.5-0.5b-dummy", "llama-3.2-1b-dummy")
GB = 10**9


def _instance() -> InstanceSpec:
    return InstanceSpec(
        name="cal-0",
        hardware="cpu",
        device_memory_bytes=4 * GB,
        host_memory_bytes=4 * GB,
        memory_utilization=0.9,
    )


def measure_model(name: str, prefill_tokens: int, decode_steps: int, reps: int) -> dict[str, Any]:
    """Prefill seconds for ``prefill_tokens`` and batch-1 / batch-8 decode step seconds."""
    inst = build_embedded(_instance(), [name], POLICIES["talaria"], torch.bfloat16)
    runner = inst.runner
    spec = runner.core.models[name]
    rng = np.random.default_rng(0)
    now = 0.0

    def ids(n: int) -> TokenSeq:
        return TokenSeq(rng.integers(1, 30000, size=n).tolist())

    runner.generate([Call("warm", 0, name, ids(64), 2)])
    prefill = []
    for r in range(reps):
        call = Call(f"p{r}", 0, name, ids(prefill_tokens), 1)
        t0 = time.perf_counter()
        runner.generate([call])
        prefill.append(time.perf_counter() - t0)
    decode: dict[int, float] = {}
    for batch in (1, 8):
        calls = [Call(f"d{batch}-{i}", 0, name, ids(256), decode_steps + 1) for i in range(batch)]
        for c in calls:
            runner.submit(c, now)
        while any(r.prefilling for r in runner.core.running.values()) or any(
            runner.core.waiting.values()
        ):
            runner.step(now)
            now += 0.001
        times = []
        for _ in range(decode_steps):
            t0 = time.perf_counter()
            runner.step(now)
            times.append(time.perf_counter() - t0)
            now += 0.001
        while not runner.idle:
            runner.step(now)
        for c in calls:
            runner.take_output(c.key)
        decode[batch] = statistics.median(times)
    out = {
        "weight_bytes": spec.weight_bytes,
        "flops_per_token": spec.flops_per_token,
        "attention_flops_prefill": spec.attention_flops(prefill_tokens * (prefill_tokens + 1) / 2),
        "prefill_tokens": prefill_tokens,
        "prefill_s": statistics.median(prefill),
        "decode_step_s_batch1": decode[1],
        "decode_step_s_batch8": decode[8],
    }
    del inst, runner
    gc.collect()
    return out


def fit(models: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Least-squares decode fit ``t = overhead + bytes / bandwidth``; prefill FLOP rate as
    the median over models of ``FLOPs / (t - overhead)``."""
    w = np.array([m["weight_bytes"] for m in models.values()], dtype=float)
    t = np.array([m["decode_step_s_batch1"] for m in models.values()], dtype=float)
    a = np.vstack([np.ones_like(w), w]).T
    (overhead, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
    overhead = max(0.0, float(overhead))
    per_byte = float(per_byte) if per_byte > 0 else float(np.mean(t / w))
    rates = []
    for m in models.values():
        flops = m["prefill_tokens"] * m["flops_per_token"] + m["attention_flops_prefill"]
        rates.append(flops / max(1e-9, m["prefill_s"] - overhead))
    return {
        "decode_weight_B_s": 1.0 / per_byte,
        "step_overhead_s": overhead,
        "prefill_flop_s": float(statistics.median(rates)),
    }


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    models: dict[str, dict[str, Any]] = {}
    for name in args.models.split(","):
        console.print(f"measuring {name}")
        models[name] = measure_model(name, args.prefill_tokens, args.decode_steps, args.reps)
    return {
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "method": "benchmarks/engine_calibration.py: EngineRunner.step on each model, bf16, "
        f"{args.threads} threads; decode on 256-token contexts, prefill {args.prefill_tokens} "
        "tokens in one chunk",
        "models": models,
        "fit": fit(models),
    }


def render(doc: dict[str, Any], console: Console) -> None:
    table = Table(title="engine calibration (bf16)", title_justify="left")
    for col in ("model", "weights GB", "prefill tok/s", "decode b1 s", "decode b8 s"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for name, m in doc["models"].items():
        table.add_row(
            name,
            f"{m['weight_bytes'] / GB:.2f}",
            f"{m['prefill_tokens'] / m['prefill_s']:.0f}",
            f"{m['decode_step_s_batch1']:.3f}",
            f"{m['decode_step_s_batch8']:.3f}",
        )
    console.print(table)
    f = doc["fit"]
    console.print(
        f"fit: decode weight bandwidth {f['decode_weight_B_s'] / GB:.1f} GB/s, step overhead "
        f"{1000 * f['step_overhead_s']:.1f} ms, prefill {f['prefill_flop_s'] / 1e9:.0f} GFLOP/s"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated catalog models")
    p.add_argument("--prefill-tokens", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=12)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--json",
        type=Path,
        default=DEFAULT_JSON,
        help="profile file to update: its 'engine' section is replaced (default: the shipped "
        "talaria/sim/cpu_profile.json)",
    )
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    args = p.parse_args(argv)
    console = Console()
    doc = run(args, console)
    render(doc, console)
    if not args.dry_run:
        profile = json.loads(args.json.read_text()) if args.json.exists() else {}
        profile["engine"] = doc
        args.json.write_text(json.dumps(profile, indent=2, sort_keys=True) + "\n")
        console.print(f"wrote the engine section of {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
