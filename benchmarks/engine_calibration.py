"""Calibrate the simulator's ``cpu`` profile from engine microbenchmarks.

The simulator prices a step as ``max(FLOPs / flop rate, bytes read / bandwidth) + a fixed
overhead``. Raw machine rates (``benchmarks/cpu_profile.py``: a square matmul, a memcpy) are
upper bounds the engine does not reach, so this script measures the embedded engine itself
through its serving path (``EngineRunner.step``: schedule, execute, commit) on each catalog
model of the embedded replay, and fits these numbers:

- decode: the time of a batch-1 decode step on a short context, per model, fitted as
  ``overhead + weight_bytes / bandwidth`` (least squares over the models);
- prefill: a 1,024-token prefill per model, fitted as ``overhead + FLOPs / flop rate``
  with the overhead from the decode fit;
- attention: decode steps of 4 sequences at 256- and 1,024-token contexts give the KV read
  rate (extra time per extra context byte); a 256-token prefill chunk from an empty cache
  and after a 1,024-token cached prefix gives the attention FLOP rate (extra time, less the
  extra KV reads, per extra attention FLOP); batch 8 against batch 1 gives the time each
  decoding sequence adds to a step;

and writes them as the ``engine`` section of ``talaria/cost/cpu_profile.json`` (``--json``),
which :func:`talaria.cost.hardware.cpu_profile_from_dict` prefers to the raw rates. Nothing
here reads replay results. About 4 minutes on 2 cores (loading the models is most of it).
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

DEFAULT_JSON = Path(__file__).resolve().parents[1] / "talaria" / "cost" / "cpu_profile.json"
MODELS = ("smollm2-135m", "qwen2.5-0.5b-dummy", "llama-3.2-1b-dummy")
GB = 10**9
ATTN_BATCH = 4  # decode batch measured at two context lengths
LONG_CTX = 1024  # the long context (the short one is 256 tokens)
CHUNK = 256  # prefill chunk measured fresh and after a LONG_CTX-token cached prefix


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

    def decode_step(batch: int, ctx: int, tag: str) -> float:
        """Median step time of ``batch`` sequences decoding on ``ctx``-token contexts."""
        nonlocal now
        calls = [Call(f"d{tag}-{i}", 0, name, ids(ctx), decode_steps + 1) for i in range(batch)]
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
        return statistics.median(times)

    decode = {1: decode_step(1, 256, "1"), 8: decode_step(8, 256, "8")}
    short_ctx = decode_step(ATTN_BATCH, 256, "a-short")
    long_ctx = decode_step(ATTN_BATCH, LONG_CTX, "a-long")
    # a CHUNK-token prefill from an empty cache and after a LONG_CTX-token cached prefix
    fresh, after = [], []
    for r in range(reps):
        t0 = time.perf_counter()
        runner.generate([Call(f"f{r}", 0, name, ids(CHUNK), 1)])
        fresh.append(time.perf_counter() - t0)
        prefix = ids(LONG_CTX)
        runner.generate([Call(f"c{r}", 0, name, prefix, 1)])
        t0 = time.perf_counter()
        runner.generate([Call(f"c{r}", 1, name, prefix.extend(ids(CHUNK).tokens()), 1)])
        after.append(time.perf_counter() - t0)
    out = {
        "weight_bytes": spec.weight_bytes,
        "flops_per_token": spec.flops_per_token,
        "attention_flops_prefill": spec.attention_flops(prefill_tokens * (prefill_tokens + 1) / 2),
        "prefill_tokens": prefill_tokens,
        "prefill_s": statistics.median(prefill),
        "decode_step_s_batch1": decode[1],
        "decode_step_s_batch8": decode[8],
        "kv_bytes_per_token": spec.kv_bytes_per_token,
        "attention_batch": ATTN_BATCH,
        "long_ctx": LONG_CTX,
        "decode_step_s_short_ctx": short_ctx,
        "decode_step_s_long_ctx": long_ctx,
        "chunk_tokens": CHUNK,
        "chunk_s_fresh": statistics.median(fresh),
        "chunk_s_after_prefix": statistics.median(after),
        "attention_flops_chunk_extra": spec.attention_flops(CHUNK * LONG_CTX),
    }
    del inst
    gc.collect()
    return out


def fit(models: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Fit the engine's step costs to the measurements of each model:

    - from models measured at two context lengths, the KV read rate: extra decode time per
      extra context byte (median over the models where the longer run took longer);
    - with it, the time each decoding sequence adds to a step: batch 8 against batch 1, less
      the extra KV reads, over 7;
    - least squares ``t = intercept + bytes / bandwidth`` over the batch-1 decode steps; the
      step overhead is the intercept less one sequence's time (a batch-1 step pays both);
    - the prefill FLOP rate, the median over models of ``FLOPs / (t - overhead)``;
    - the attention FLOP rate: the extra time of a chunk after a cached prefix, less its
      extra KV reads, per extra attention FLOP.
    """
    out: dict[str, float] = {}
    long = [m for m in models.values() if "decode_step_s_long_ctx" in m]
    kv_rates = []
    for m in long:
        extra_kv = m["attention_batch"] * (m["long_ctx"] - 256) * m["kv_bytes_per_token"]
        dt = m["decode_step_s_long_ctx"] - m["decode_step_s_short_ctx"]
        if dt > 0:
            kv_rates.append(extra_kv / dt)
    per_seq = 0.0
    if kv_rates:
        kv_rate = out["decode_kv_B_s"] = float(statistics.median(kv_rates))
        seq_times = [
            x
            for m in long
            if (
                x := (
                    m["decode_step_s_batch8"]
                    - m["decode_step_s_batch1"]
                    - 7 * 256 * m["kv_bytes_per_token"] / kv_rate
                )
                / 7
            )
            > 0
        ]
        if seq_times:
            per_seq = out["decode_seq_s"] = float(statistics.median(seq_times))
    w = np.array([m["weight_bytes"] for m in models.values()], dtype=float)
    t = np.array([m["decode_step_s_batch1"] for m in models.values()], dtype=float)
    a = np.vstack([np.ones_like(w), w]).T
    (intercept, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
    overhead = max(0.0, float(intercept) - per_seq)
    per_byte = float(per_byte) if per_byte > 0 else float(np.mean(t / w))
    rates = []
    for m in models.values():
        flops = m["prefill_tokens"] * m["flops_per_token"] + m["attention_flops_prefill"]
        rates.append(flops / max(1e-9, m["prefill_s"] - overhead))
    out |= {
        "decode_weight_B_s": 1.0 / per_byte,
        "step_overhead_s": overhead,
        "prefill_flop_s": float(statistics.median(rates)),
    }
    if kv_rates:
        attn_rates = []
        for m in long:
            reads = m["long_ctx"] * m["kv_bytes_per_token"] / out["decode_kv_B_s"]
            dt = m["chunk_s_after_prefix"] - m["chunk_s_fresh"] - reads
            if dt > 0:
                attn_rates.append(m["attention_flops_chunk_extra"] / dt)
        if attn_rates:
            out["attention_flop_s"] = float(statistics.median(attn_rates))
    return out


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
        f"tokens in one chunk; attention: decode batch {ATTN_BATCH} at 256 and {LONG_CTX}-token "
        f"contexts, a {CHUNK}-token chunk fresh and after a {LONG_CTX}-token cached prefix",
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
    if "decode_kv_B_s" in f:
        console.print(f"fit: KV reads {f['decode_kv_B_s'] / GB:.1f} GB/s")
    if "attention_flop_s" in f:
        console.print(f"fit: attention {f['attention_flop_s'] / 1e9:.0f} GFLOP/s")
    if "decode_seq_s" in f:
        console.print(f"fit: {1000 * f['decode_seq_s']:.1f} ms per decoding sequence")


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
        "talaria/cost/cpu_profile.json)",
    )
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    p.add_argument(
        "--refit",
        action="store_true",
        help="measure nothing: fit again the measurements already in --json's engine section "
        "(after a change to the fit)",
    )
    args = p.parse_args(argv)
    console = Console()
    if args.refit:
        stored = json.loads(args.json.read_text()).get("engine") if args.json.exists() else None
        if not isinstance(stored, dict) or not isinstance(stored.get("models"), dict):
            console.print(f"{args.json} has no engine measurements to refit; run without --refit")
            return 2
        doc = {**stored, "fit": fit(stored["models"])}
    else:
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
