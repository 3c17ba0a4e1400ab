"""How the session-aware slot order's starvation bound trades SCT for TTFT, in the simulator
on the embedded replay's workload (12 real sessions, SmolLM2 plus two random-weight models
on the CPU instance of ``talaria replay --substrate embedded``, the shipped ``cpu`` profile),
or with ``--paper`` on the paper set of ``talaria replay`` (30 sessions, 960 calls, one
simulated 8 x H200 server), where it also runs without a bound.

Beside the bound, it runs the model-serial reference in every order of the model groups:
whatever group a one-group-at-a-time order serves first, its figures are among these.

The shipped bound (``slot_starvation_s`` = 300 s) is fixed a priori (PolicyConfig's
docstring); this varies it only to show what the bound costs and what the unmet TTFT goal
would cost. "longest slot wait" is the longest any call waited for admission. It prints a
table and writes ``--json``. About a minute (loading SmolLM2's GGUF for its shape).

    python benchmarks/slot_starvation.py --json benchmarks/results/slot_starvation.json
    python benchmarks/slot_starvation.py --paper --json benchmarks/results/starvation_paper.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from rich.console import Console
from rich.table import Table

from talaria.backends.embedded import load_catalog_model
from talaria.cli import EMBEDDED_CONTEXT, EMBEDDED_TOKEN_SCALE
from talaria.config import ClusterConfig, ModelSpec
from talaria.cost import cluster_estimators
from talaria.engine.catalog import DEFAULT_MODELS, arch_of, entry
from talaria.errors import UnknownModel
from talaria.policy.baselines import POLICIES, policy
from talaria.session.gaps import GapPredictor
from talaria.sim.simulator import SimResult, Simulator
from talaria.swebench_replay.driver import cluster_for, to_scripts
from talaria.swebench_replay.live_replay import EmbeddedOptions
from talaria.swebench_replay.metrics import policy_summary
from talaria.swebench_replay.references import model_serial
from talaria.swebench_replay.setup import load_workload

BOUNDS_S = (300.0, 20.0, 10.0, 5.0)
PAPER_BOUNDS_S = (300.0, float("inf"))
KEYS = ("sct_p50_s", "sct_p95_s", "ttft_p95_s", "model_switches", "longest_wait_s")


def _spec(name: str) -> ModelSpec:
    try:
        arch = arch_of(entry(name))
    except UnknownModel:  # SmolLM2: its shape is read from its GGUF file
        arch = load_catalog_model(name, torch.bfloat16).arch
    return arch.to_spec(name, torch.bfloat16)


def _embedded() -> tuple[Any, ClusterConfig]:
    w = load_workload(
        n_sessions=12,
        target_calls=96,
        seed=0,
        arrival="all",
        models=DEFAULT_MODELS,
        max_context=EMBEDDED_CONTEXT,
        token_scale=EMBEDDED_TOKEN_SCALE,
    )
    instance = EmbeddedOptions(
        policies=(policy("talaria"),), models=DEFAULT_MODELS
    ).instance_specs()[0]
    return w, ClusterConfig([_spec(m) for m in DEFAULT_MODELS], (instance,))


def _short(model: str) -> str:
    """A model's family name (``llama-3.2-1b-dummy``: llama; ``mistralai/Mixtral-8x22B``:
    Mixtral), for row labels."""
    return model.rsplit("/", 1)[-1].split("-", 1)[0]


def _row(result: SimResult) -> dict[str, float]:
    s = policy_summary(result)
    row = {k: s[k] for k in KEYS[:-1]}
    row["longest_wait_s"] = max(c.admitted_s - c.arrival_s for c in result.calls)
    return row


def run(paper: bool = False) -> dict[str, Any]:
    w, cluster = (load_workload(), cluster_for("h200-tp8", 1)) if paper else _embedded()
    estimators = cluster_estimators(cluster)
    scripts = to_scripts(w.replay, w.tool_table)

    def summary(p: Any) -> dict[str, float]:
        return _row(Simulator(cluster, p, estimators, learner=GapPredictor.default).run(scripts))

    rows: dict[str, dict[str, float]] = {}
    for bound in PAPER_BOUNDS_S if paper else BOUNDS_S:
        label = "none (diagnostic)" if bound == float("inf") else f"{bound:g}"
        rows[f"talaria, slot_starvation_s {label}"] = summary(
            attrs.evolve(POLICIES["talaria"], slot_starvation_s=bound)
        )
    rows["round"] = summary(POLICIES["round"])
    groups: dict[tuple[str, ...], SimResult] = {}

    def serial_group(part: Sequence[Any]) -> SimResult:
        key = tuple(s.session_id for s in part)
        if key not in groups:
            groups[key] = Simulator(cluster, POLICIES["talaria"], estimators).run(part)
        return groups[key]

    serial = model_serial(scripts, serial_group)
    rows["model-serial (reference)"] = _row(serial)
    # every other order of the model groups: what no slot order that serves one model's
    # sessions to completion before the next can beat, whichever group it puts first
    models = sorted({s.model for s in scripts})
    for order in itertools.permutations(models):
        result = model_serial(scripts, serial_group, order)
        rows[f"model-serial, {' > '.join(_short(m) for m in order)}"] = _row(result)
    hardware = "h200-tp8 (simulated)" if paper else "cpu (simulated)"
    return {"workload": w.replay.trace, "hardware": hardware, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--paper", action="store_true", help="the paper set of `talaria replay` instead"
    )
    args = parser.parse_args(argv)
    doc = run(args.paper)
    table = Table(title=f"starvation bound vs SCT and TTFT ({doc['hardware']})")
    cols = ("policy", "SCT p50 s", "SCT p95 s", "TTFT p95 s", "switches", "longest slot wait s")
    for col in cols:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, r in doc["rows"].items():
        table.add_row(
            name,
            f"{r['sct_p50_s']:.1f}",
            f"{r['sct_p95_s']:.1f}",
            f"{r['ttft_p95_s']:.1f}",
            str(int(r["model_switches"])),
            f"{r['longest_wait_s']:.1f}",
        )
    Console(width=max(120, Console().width)).print(table)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
