"""Two instances of the embedded replay in the simulator: models shared, or pinned.

Replays the embedded workload (``talaria replay --substrate embedded``'s 12 sessions / 96
calls) through the simulator on two ``cpu`` instances priced by the calibration a results
document records (``--results``, e.g. ``docs/results/replay-embedded-2-instances-c98c1de.json``),
with every model on both instances (``shared``) or llama alone on one and SmolLM2 and Qwen on
the other (``pinned``, through ``InstanceSpec.models``), for talaria, talaria with sticky
routing, round and sticky. Prints SCT p50 / p95 and TTFT p95; a few seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json

import attrs
import torch

from talaria.backends.embedded import load_catalog_model
from talaria.calibration.cache import shipped_calibration
from talaria.cli import EMBEDDED_CALLS, EMBEDDED_CONTEXT, EMBEDDED_SESSIONS, EMBEDDED_TOKEN_SCALE
from talaria.config import ClusterConfig, Routing
from talaria.cost import cluster_estimators
from talaria.engine.catalog import DEFAULT_MODELS
from talaria.policy.baselines import POLICIES
from talaria.session.gaps import GapPredictor
from talaria.sim.simulator import Simulator
from talaria.swebench_replay.driver import to_scripts
from talaria.swebench_replay.live_replay import EmbeddedOptions
from talaria.swebench_replay.metrics import policy_summary
from talaria.swebench_replay.setup import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, required=True, help="results.json with a calibration")
    args = ap.parse_args()
    profile = json.loads(args.results.read_text())["calibration"]["profile"]
    prof = attrs.evolve(shipped_calibration().profile, **profile)
    w = load_workload(
        n_sessions=EMBEDDED_SESSIONS,
        target_calls=EMBEDDED_CALLS,
        models=DEFAULT_MODELS,
        max_context=EMBEDDED_CONTEXT,
        token_scale=EMBEDDED_TOKEN_SCALE,
    )
    scripts = to_scripts(w.replay, w.tool_table, 1.0, True)
    loaded = {n: load_catalog_model(n, torch.bfloat16, weights=False) for n in DEFAULT_MODELS}
    specs = [m.arch.to_spec(n, torch.bfloat16, source=m.source) for n, m in loaded.items()]
    base = EmbeddedOptions((POLICIES["talaria"],), instances=2).instance_specs()
    small, mid, large = DEFAULT_MODELS
    talaria = POLICIES["talaria"]
    policies = [
        talaria,
        attrs.evolve(talaria, name="talaria, sticky routing", routing=Routing.STICKY),
        POLICIES["round"],
        POLICIES["sticky"],
    ]
    for label, parts in (
        ("shared", (DEFAULT_MODELS, DEFAULT_MODELS)),
        ("pinned", ((small, mid), (large,))),
    ):
        cluster = ClusterConfig(
            specs, tuple(attrs.evolve(b, models=p) for b, p in zip(base, parts, strict=True))
        )
        ests = cluster_estimators(cluster, {"cpu": prof})
        for p in policies:
            s = policy_summary(
                Simulator(cluster, p, ests, learner=GapPredictor.default).run(scripts)
            )
            print(
                f"{label:7s} {p.name:24s} p50 {s['sct_p50_s']:6.1f} p95 {s['sct_p95_s']:6.1f} s"
                f"  TTFT p95 {s['ttft_p95_s']:5.1f} s"
            )


if __name__ == "__main__":
    main()
