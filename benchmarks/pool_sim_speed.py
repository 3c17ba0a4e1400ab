"""How fast the simulator plays the serverless pool: one ``talaria load`` point, timed.

Builds the point ``talaria load`` would play (the 43-model Zipf catalog on ``--instances``
TP4 H200 instances, ``--sessions`` Poisson arrivals of the test part at ``--rate``, seed 0)
and runs it under talaria, printing the calls answered every 200 calls with the wall time,
then the simulated and wall seconds of the whole point (``--json PATH`` writes them).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import time

from talaria.cost import cluster_estimators
from talaria.policy.baselines import TALARIA
from talaria.session.gaps import GapPredictor
from talaria.sim.pool_catalog import pool_catalog
from talaria.sim.simulator import Simulator
from talaria.swebench_replay.load_sweep import LoadSetting, open_load
from talaria.swebench_replay.split import Part


def main() -> int:
    """Time one point; mutates nothing but ``--json``'s file."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    setting = LoadSetting(pool_catalog(), args.instances, args.sessions)
    load = open_load(setting, Part.TEST, args.rate, 0)
    cluster = setting.cluster()
    sim = Simulator(cluster, TALARIA, cluster_estimators(cluster), learner=GapPredictor.default)
    started = time.monotonic()

    def tick(n: int) -> None:
        if n % 200 == 0:
            print(f"{n} calls in {time.monotonic() - started:.1f} s", flush=True)

    result = sim.run(load.scripts, tick)
    wall = time.monotonic() - started
    doc = {
        "instances": args.instances,
        "sessions": args.sessions,
        "rate_per_s": args.rate,
        "calls": load.n_calls,
        "simulated_s": result.end_s,
        "wall_s": wall,
    }
    print(json.dumps(doc))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
