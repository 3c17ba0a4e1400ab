"""Calibrate the shipped ``cpu`` profile from engine microbenchmarks.

The measuring and the fit are the library's (:mod:`talaria.calibration.engine`,
one implementation for this script and for the calibration ``talaria replay --substrate
embedded`` makes where it runs, :mod:`talaria.calibration.calibrate`): each catalog model of
the embedded replay stepped as the live runtime steps it (plan and commit on an event loop,
``EngineRunner.execute`` on a worker thread), fitted to a decode weight-read bandwidth, a
step overhead, a prefill FLOP rate, a KV read rate, an attention FLOP rate and a time per
decoding sequence. This script loads each model from disk in turn, measures it, and writes
the result as the ``engine`` section of ``talaria/cost/cpu_profile.json`` (``--json``),
which :func:`talaria.cost.hardware.cpu_profile_from_dict` prefers to the raw rates. Nothing
here reads replay results. About 4 minutes on 2 cores (loading the models is most of it).
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from rich.console import Console
from rich.table import Table

from talaria.backends.embedded import load_catalog_model
from talaria.calibration.engine import fit, measure_engine, small_rows
from talaria.calibration.plan import EngineBench
from talaria.engine.catalog import DEFAULT_MODELS
from talaria.engine.loader import LoadedModel

DEFAULT_JSON = Path(__file__).resolve().parents[1] / "talaria" / "cost" / "cpu_profile.json"
MODELS = DEFAULT_MODELS
GB = 10**9
MEASURED_BY = "benchmarks/engine_calibration.py"


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    bench = attrs.evolve(
        EngineBench(),
        prefill_tokens=args.prefill_tokens,
        decode_steps=args.decode_steps,
        reps=args.reps,
    )

    def from_disk() -> Iterator[tuple[str, LoadedModel, torch.Tensor | None]]:
        for name in args.models.split(","):
            model = load_catalog_model(name, torch.bfloat16)
            yield name, model, None
            del model
            gc.collect()

    return measure_engine(
        from_disk, bench, torch.bfloat16, MEASURED_BY, lambda n: console.print(f"measuring {n}")
    )


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
    p.add_argument("--prefill-tokens", type=int, default=EngineBench().prefill_tokens)
    p.add_argument("--decode-steps", type=int, default=EngineBench().decode_steps)
    p.add_argument("--reps", type=int, default=EngineBench().reps)
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
        specs = {
            name: load_catalog_model(name, torch.bfloat16, weights=False).arch.to_spec(
                name, torch.bfloat16
            )
            for name in stored["models"]
        }
        doc = {**stored, "fit": fit(stored["models"], specs, small_rows(torch.bfloat16))}
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
