"""A replay's steps alone: how much slower the live runtime runs a step than the bare engine
runs the same step, and the per-step prices the bare steps fit.

Reads ``steps.json`` of a real-engine replay (``benchmarks/gpu_replay.py``, or ``talaria
replay --substrate embedded``: every executed step with its shape and measured seconds),
takes up to ``--per-kind`` steps of each model and kind (decode, prefill, mixed), evenly over
the replay, rebuilds each step's batch from what the log records, and times it alone on the
engine's forward (random weights in a region of their own, a zeroed KV pool on the device,
the device synchronised around each step; the median of ``--reps`` after a warm-up):

- decode: ``decodes`` sequences whose contexts sum to the logged ``context_tokens``, spread
  from 0.5x to 1.5x their mean (the replay's batches mix lengths, so its steps carry a
  padding mask, and so do these);
- prefill: ``prefill_tokens`` over ``prefill_chunks`` sequences, each after the cached prefix
  that gives the logged attended keys.

Reports, per model and kind, the median of inside / alone (the runtime's cost on top of the
engine), the replay's price of the step (the profile it ran under) against both, and the
prices :func:`talaria.calibration.linear.fit_shapes` fits to the steps alone and to the steps
inside (with 5-fold held-out errors): the hardware profile's step prices, measured. A
PyTorch profiler table of a few steps of the slowest kind alone goes to ``--out``'s
``.profile.txt``. ``--tiny``: the tiny models on the CPU (the test).

    python benchmarks/gpu_steps.py --steps runs/gpu-replay/steps.json --out gpu_steps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_engine import RandomWeights
from benchmarks.gpu_replay import BIG, TINY
from talaria.backends.embedded import load_catalog_model
from talaria.calibration.engine import small_rows
from talaria.calibration.grid import BLOCK_TOKENS, BareForward
from talaria.calibration.linear import fit_shapes
from talaria.config import ModelSpec
from talaria.cost.step_shape import StepShape
from talaria.engine.arch import ModelArch
from talaria.engine.batch import BatchInput, SeqInput
from talaria.engine.runner import flatten_weights
from talaria.engine.threads import in_own_thread

KINDS = ("decode", "prefill", "mixed")


def kind_of(step: Mapping[str, Any]) -> str | None:
    """The logged step's kind, or None for a step that ran no forward (a switch alone)."""
    if step["model"] is None or (step["prefill_tokens"] == 0 and step["decodes"] == 0):
        return None
    if step["prefill_tokens"] and step["decodes"]:
        return "mixed"
    return "prefill" if step["prefill_tokens"] else "decode"


def sample(steps: Sequence[Mapping[str, Any]], per_kind: int) -> list[Mapping[str, Any]]:
    """Up to ``per_kind`` steps of each (model, kind), evenly spaced over the log."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for st in steps:
        kind = kind_of(st)
        if kind is not None:
            groups.setdefault((st["model"], kind), []).append(st)
    out: list[Mapping[str, Any]] = []
    for group in groups.values():
        idx = np.linspace(0, len(group) - 1, min(per_kind, len(group))).round().astype(int)
        out.extend(group[i] for i in sorted(set(idx.tolist())))
    return out


def decode_contexts(n: int, total: int) -> list[int]:
    """``n`` contexts summing to ``total`` (each at least 1), spread 0.5x..1.5x the mean."""
    if n == 1:
        return [max(1, total)]
    mean = total / n
    ctx = [max(1, round(mean * (0.5 + i / (n - 1)))) for i in range(n)]
    ctx[-1] = max(1, ctx[-1] + total - sum(ctx))
    return ctx


def prefill_chunks(step: Mapping[str, Any]) -> list[tuple[int, int]]:
    """``(chunk, prefix)`` per prefilling sequence: the logged tokens split evenly, every
    sequence after the prefix that makes the attended keys the logged sum."""
    k, tokens = max(1, step["prefill_chunks"]), step["prefill_tokens"]
    chunks = [tokens // k + (1 if i < tokens % k else 0) for i in range(k)]
    own = sum(n * (n + 1) / 2 for n in chunks)
    prefix = max(0, round((step["prefill_attn_tokens"] - own) / tokens))
    return [(n, prefix) for n in chunks if n > 0]


def batch_of(step: Mapping[str, Any], vocab: int) -> tuple[BatchInput, int]:
    """The step's batch and the KV blocks it spans (block tables laid end to end)."""
    seqs: list[SeqInput] = []
    first = 0

    def add(n_new: int, start: int) -> None:
        nonlocal first
        blocks = -(-(start + n_new) // BLOCK_TOKENS)
        ids = tuple(1 + (start + i) % (vocab - 1) for i in range(n_new))
        seqs.append(SeqInput(ids, start, tuple(range(first, first + blocks))))
        first += blocks

    for chunk, prefix in prefill_chunks(step) if step["prefill_tokens"] else []:
        add(chunk, prefix)
    for ctx in decode_contexts(step["decodes"], step["context_tokens"]) if step["decodes"] else []:
        add(1, ctx)
    return BatchInput(seqs), first  # type: ignore[arg-type]  # attrs converter=tuple


def shape_of(step: Mapping[str, Any]) -> StepShape:
    """The logged step's shape, as the cost model prices it."""
    chunks = prefill_chunks(step) if step["prefill_tokens"] else []
    return StepShape(
        step["prefill_tokens"],
        float(step["prefill_attn_tokens"]),
        step["decodes"],
        step["context_tokens"],
        len(chunks),
        float(sum(p for _, p in chunks)),
    )


Weights = Callable[[str], tuple[ModelArch, torch.Tensor]]
"""A model's architecture and its weights flattened into host bytes (the runner's layout)."""

DTYPE = torch.bfloat16


def random_weights(configs: Mapping[str, Mapping[str, Any]], device: torch.device) -> Weights:
    """The published configurations' random weights, made on ``device`` (the GPU replay's)."""

    def of(name: str) -> tuple[ModelArch, torch.Tensor]:
        arch = ModelArch.from_hf_config(dict(configs[name]))
        made = RandomWeights(arch, device, DTYPE, 1000 * list(configs).index(name))
        return arch, flatten_weights(name, arch, made, DTYPE)

    return of


def catalog_weights(name: str) -> tuple[ModelArch, torch.Tensor]:
    """A catalog model's weights as the embedded replay loads them (the CPU replay's)."""
    model = load_catalog_model(name, DTYPE)
    return model.arch, flatten_weights(name, model.arch, model.tensors, DTYPE)


def measure(
    weights: Weights,
    steps: Sequence[Mapping[str, Any]],
    device: torch.device,
    reps: int,
    specs: dict[str, ModelSpec],
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Every sampled step timed alone, one model at a time (its region freed before the
    next), on the calling thread: the logged row with ``alone_s`` and ``kind`` added.
    Records each model's spec in ``specs``."""
    rows: list[dict[str, Any]] = []
    for name in sorted({st["model"] for st in steps}):
        mine = [st for st in steps if st["model"] == name]
        arch, flat = weights(name)
        specs[name] = arch.to_spec(name)
        batches = [batch_of(st, arch.vocab_size) for st in mine]
        progress(f"{name}: {len(mine)} steps alone")
        bare = BareForward(arch, flat, DTYPE, max(blocks for _, blocks in batches), device)
        del flat
        for st, (batch, _) in zip(mine, batches, strict=True):
            rows.append({**st, "kind": kind_of(st), "alone_s": bare.time(batch, reps)})
        del bare
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _median_ratio(rows: Sequence[Mapping[str, Any]], top: str, bottom: str) -> float:
    return float(statistics.median(r[top] / r[bottom] for r in rows))


def summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per kind and per (model, kind): steps, median inside/alone, median priced/alone and
    priced/inside, and the summed seconds of each."""
    out: dict[str, Any] = {}
    keys = [(k, None) for k in KINDS] + sorted({(r["kind"], r["model"]) for r in rows})
    for kind, model in keys:
        group = [r for r in rows if r["kind"] == kind and model in (None, r["model"])]
        if not group:
            continue
        out[kind if model is None else f"{model}/{kind}"] = {
            "steps": len(group),
            "inside_over_alone_p50": _median_ratio(group, "seconds", "alone_s"),
            "priced_over_alone_p50": _median_ratio(group, "predicted_s", "alone_s"),
            "priced_over_inside_p50": _median_ratio(group, "predicted_s", "seconds"),
            "inside_s": sum(r["seconds"] for r in group),
            "alone_s": sum(r["alone_s"] for r in group),
            "priced_s": sum(r["predicted_s"] for r in group),
        }
    return out


def fit(
    rows: Sequence[Mapping[str, Any]], specs: Mapping[str, ModelSpec], column: str, small: int
) -> dict[str, Any]:
    """The step prices fitted to ``column``'s seconds of every row (``small``: the rows the
    engine multiplies with its native small-batch product), their errors on their own rows
    and under 5-fold held-out fits (row ``i`` predicted by a fit without its fold), overall
    and per model and kind."""
    data = [(specs[r["model"]], shape_of(r), r[column]) for r in rows]
    prices = fit_shapes(data, small)
    own = [(prices.step_s(m, s) - t) / t for m, s, t in data]
    held: list[float] = [0.0] * len(data)
    for f in range(5):
        fold = fit_shapes([d for i, d in enumerate(data) if i % 5 != f], small)
        for i, (m, s, t) in enumerate(data):
            if i % 5 == f:
                held[i] = (fold.step_s(m, s) - t) / t
    groups: dict[str, list[float]] = {}
    for r, e in zip(rows, held, strict=True):
        groups.setdefault(f"{r['model']}/{r['kind']}", []).append(e)
    return {
        "prices": prices.to_json(),
        "held_out_error_p50_by_model_kind": {k: float(np.median(v)) for k, v in groups.items()},
        "own_abs_error_p50": float(np.median(np.abs(own))),
        "held_out_abs_error_p50": float(np.median(np.abs(held))),
        "held_out_abs_error_p90": float(np.quantile(np.abs(held), 0.9)),
    }


def profile_steps(bare_of: Callable[[], BareForward], batch: BatchInput, out: Path) -> None:
    """A PyTorch profiler table (self time, top 25 ops) of five forwards of ``batch``."""
    bare = bare_of()
    bare.time(batch, 1)  # warm-up
    acts = [torch.profiler.ProfilerActivity.CPU]
    if bare.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof, torch.inference_mode():
        for _ in range(5):
            bare.model.forward(batch, bare.kv)
        bare.sync()
    sort = "self_cuda_time_total" if bare.device.type == "cuda" else "self_cpu_time_total"
    out.write_text(prof.key_averages().table(sort_by=sort, row_limit=25) + "\n")


def _profile_slowest(
    weights: Weights, rows: Sequence[Mapping[str, Any]], device: torch.device, out: Path
) -> None:
    worst = max(rows, key=lambda r: r["seconds"] / r["alone_s"])
    arch, flat = weights(worst["model"])
    batch, blocks = batch_of(worst, arch.vocab_size)
    profile_steps(lambda: BareForward(arch, flat, DTYPE, blocks, device), batch, out)


def run(args: argparse.Namespace, weights: Weights, device: torch.device) -> dict[str, Any]:
    """Every policy's sampled steps alone, their summaries and the two fits (written to
    ``args.out`` before the profile runs)."""
    log = json.loads(args.steps.read_text())
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "steps_file": str(args.steps),
        "policies": {},
    }
    specs: dict[str, ModelSpec] = {}
    for policy, steps in log.items():
        picked = sample(steps, args.per_kind)
        rows = measure(weights, picked, device, args.reps, specs, print_err)
        doc["policies"][policy] = {"summary": summary(rows), "rows": rows}
    every = [r for p in doc["policies"].values() for r in p["rows"]]
    small = small_rows(torch.bfloat16) if device.type == "cpu" else 0
    doc["fit_alone"] = fit(every, specs, "alone_s", small)
    doc["fit_inside"] = fit(every, specs, "seconds", small)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    _profile_slowest(weights, every, device, args.out.with_suffix(".profile.txt"))
    return doc


def print_err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def report(doc: Mapping[str, Any]) -> None:
    for policy, p in doc["policies"].items():
        for key, s in p["summary"].items():
            inside, priced = s["inside_over_alone_p50"], s["priced_over_inside_p50"]
            print(
                f"{policy:13s} {key:32s} n={s['steps']:3d} inside/alone {inside:.2f}  "
                f"priced/inside {priced:.2f}"
            )
    for which in ("fit_alone", "fit_inside"):
        f = doc[which]
        print(
            f"{which}: held-out |error| p50 {f['held_out_abs_error_p50']:.1%} "
            f"p90 {f['held_out_abs_error_p90']:.1%}; prices {f['prices']}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="A real-engine replay's steps timed alone on the bare engine: the "
        "runtime's cost per step kind, and the step prices the measured steps fit.",
    )
    ap.add_argument("--steps", type=Path, required=True, help="a replay's steps.json")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-steps.json"), help="JSON out")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--tiny", action="store_true", help="the tiny models on the CPU")
    mode.add_argument(
        "--catalog",
        action="store_true",
        help="the CPU embedded replay's catalog models (talaria replay --substrate embedded), "
        "on the CPU, on a thread of its own as the replay's worker runs them",
    )
    ap.add_argument("--per-kind", type=int, default=40, help="steps per model and kind")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per step")
    args = ap.parse_args(argv)
    if args.per_kind < 1 or args.reps < 1:
        ap.error("--per-kind and --reps must be at least 1")
    cpu = args.tiny or args.catalog
    device = torch.device("cpu" if cpu else "cuda")
    if not cpu and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --tiny or --catalog on the CPU")
    if args.catalog:
        weights: Weights = catalog_weights
    else:
        weights = random_weights(TINY if args.tiny else BIG, device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report(in_own_thread(lambda: run(args, weights, device), "talaria-steps-alone"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
