"""Which bf16 product is faster on this CPU at each row count: the evidence for
``talaria.engine.ops.TRANSPOSED_ROWS``.

For each catalog model (random weights in the engine's own layout: fused q/k/v and
gate/up views where the layout has them) times one decoder layer's projections, and the
output head, as ``F.linear(x, w)`` and as ``(w @ x.T).T``, for ``x`` of M rows. It runs on
a worker thread with the engine's thread count, as the live runtime executes steps (a step
on a worker thread runs measurably slower than on the main thread). Prints milliseconds per
layer (median of ``--reps``) and the ratio transposed / F.linear (> 1: F.linear is faster);
``--json PATH`` writes the rows. A few seconds per model; no weights are read from disk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from talaria.backends.embedded import load_catalog_model
from talaria.engine.catalog import DEFAULT_MODELS
from talaria.engine.weight_layout import bind_weights, layer_views

ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)
DTYPE = torch.bfloat16

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t()


def _plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _weights(name: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One layer's projections as the engine calls them, and the output head."""
    arch = load_catalog_model(name, DTYPE, weights=False).arch  # reads no tensors
    region = torch.empty(arch.weight_bytes(DTYPE), dtype=torch.uint8)
    views = bind_weights(arch, region, DTYPE)
    for v in views.values():
        v.normal_(0.0, 0.02)
    layer = layer_views(views, arch, 0)
    qkv = [layer.qkv] if layer.qkv is not None else [layer.q, layer.k, layer.v]
    mlp = [layer.gate_up] if layer.gate_up is not None else [layer.gate, layer.up]
    tied = arch.tie_word_embeddings
    head = views["model.embed_tokens.weight" if tied else "lm_head.weight"]
    return [*qkv, layer.o, *mlp, layer.down], head


def _time(fn: Product, ws: Sequence[torch.Tensor], m: int, reps: int) -> float:
    """Median seconds of one pass of ``fn`` over ``ws`` with ``m`` rows."""
    xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=DTYPE) for w in ws}
    for w in ws:
        fn(xs[w.shape[1]], w)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in ws:
            fn(xs[w.shape[1]], w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(models: Sequence[str], rows: Sequence[int], reps: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in models:
        layer, head = _weights(name)
        for part, ws in (("layer", layer), ("head", [head])):
            for m in rows:
                plain = _time(_plain, ws, m, reps)
                trans = _time(_transposed, ws, m, reps)
                out.append(
                    {
                        "model": name,
                        "part": part,
                        "rows": m,
                        "f_linear_ms": plain * 1e3,
                        "transposed_ms": trans * 1e3,
                        "ratio": trans / plain,
                    }
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help="catalog models")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M")
    ap.add_argument("--reps", type=int, default=9, help="timed passes per cell (median)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    rows = [int(r) for r in args.rows.split(",") if r]
    result: list[dict[str, Any]] = []

    def work() -> None:  # on a worker thread, as the live runtime executes steps
        torch.set_num_threads(args.threads)  # per thread: a new thread starts at the default
        result.extend(measure(models, rows, args.reps))

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    table = Table(title=f"bf16 products, {args.threads} threads, ms (median of {args.reps})")
    for col in ("model", "part", "M", "F.linear", "(w @ x.T).T", "ratio"):
        table.add_column(col, justify="right")
    for r in result:
        table.add_row(
            r["model"],
            r["part"],
            str(r["rows"]),
            f"{r['f_linear_ms']:.2f}",
            f"{r['transposed_ms']:.2f}",
            f"{r['ratio']:.2f}",
        )
    Console().print(table)
    if args.json:
        doc = {"threads": args.threads, "reps": args.reps, "rows": result}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
