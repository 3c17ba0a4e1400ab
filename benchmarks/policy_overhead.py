"""Time per routing-plus-admission decision at scale, in pure Python.

Builds a cluster of ``--instances`` TP8 H200 instances serving the three paper-scale models,
brings ``--sessions`` live sessions into it through the real flow (each session's first call
is routed, admitted, answered, and the session enters a tool gap with a reservation), then
times ``--decisions`` continuation calls of random sessions: one decision is
``ClusterCore.place`` (the router ranks every instance that serves the model; "route") plus
the chosen instance's ``schedule`` (admission with reservations, committing the call's KV
blocks, and the step plan; "admit"). A ``schedule`` that opens a slot admits the model's
whole queue, so its time is divided by the calls it admitted; the whole call is reported
too ("schedule"), with the eviction work (demoting KV blocks to host) it includes. The calls are
then answered (untimed) so the state stays steady.

Reports median and p99 in microseconds (``--json PATH`` writes them). The target is a p99
under 500 us.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.progress import track
from rich.table import Table

from talaria.config import ClusterConfig
from talaria.core.cluster import ClusterCore
from talaria.core.instance import InstanceCore
from talaria.cost.cost_model import CostModel
from talaria.cost.estimator import CostModelEstimator, Estimator
from talaria.cost.hardware import profile
from talaria.policy.baselines import POLICIES
from talaria.schedule import Executed, Request
from talaria.sim.catalog import PAPER_MODELS
from talaria.types import Call, EventKind, TokenSeq


def build(n_instances: int, policy: str, pack_slack: float = 0.0) -> ClusterCore:
    hw = profile("h200-tp8")
    base = hw.instances(1)[0]
    specs = [attrs.evolve(base, name=f"i{i}") for i in range(n_instances)]
    cluster = ClusterConfig(models=PAPER_MODELS, instances=specs)
    estimators: dict[str, Estimator] = {
        s.name: CostModelEstimator(CostModel(hw, s.n_devices), PAPER_MODELS) for s in specs
    }
    config = attrs.evolve(POLICIES[policy], pack_slack=pack_slack)
    return ClusterCore(cluster, config, estimators)


def run_call(core: ClusterCore, call: Call, history: TokenSeq, now: float) -> InstanceCore:
    inst, _, _ = core.place(call, call.max_new_tokens, history, now)
    for req in drain(inst, now):
        core.on_finished(req)
    return inst


def bring_live(
    core: ClusterCore, sessions: int, prompt_tokens: int, rng: random.Random
) -> tuple[dict[str, TokenSeq], float]:
    """Bring ``sessions`` sessions live through the real flow: each one's first call (a
    random prompt of ``prompt_tokens``, one of the three models in turn) routed, admitted and
    answered with 64 tokens, then a tool gap with a reservation. Returns each session's
    history and the clock after the last (1 ms between sessions)."""
    models = [m.name for m in PAPER_MODELS]
    histories: dict[str, TokenSeq] = {}
    now = 0.0
    for k in track(range(sessions), description="bringing sessions live"):
        sid = f"s{k}"
        prompt = TokenSeq(rng.randrange(32000) for _ in range(prompt_tokens))
        call = Call(sid, 0, models[k % 3], prompt, 64, 64, arrival_s=now)
        histories[sid] = prompt.extend(rng.randrange(32000) for _ in range(64))
        run_call(core, call, histories[sid], now)
        core.event(call.session, EventKind.TOOL_START, 0.3, now)
        now += 0.001
    return histories, now


def drain(inst: InstanceCore, now: float) -> list[Request]:
    """Run the instance until its queue and batch are empty (untimed bookkeeping)."""
    done: list[Request] = []
    for _ in range(10_000):
        sched = inst.schedule(now)
        repeat = sched.step.repeat if sched.step is not None else 1
        done += inst.commit(sched, Executed(()), now, repeat=repeat)  # its stage copied too
        if sched.switch is None and sched.step is None and not sched.waiting_for_stage:
            break
    return done


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    core = build(args.instances, args.policy, args.pack_slack)
    models = [m.name for m in PAPER_MODELS]
    histories, now = bring_live(core, args.sessions, args.prompt_tokens, rng)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()  # as a long-running server does after warm-up: old objects are not rescanned
    samples = []
    index = dict.fromkeys(histories, 1)
    for _ in track(range(args.decisions), description="timed decisions"):
        sid = f"s{rng.randrange(args.sessions)}"
        prompt = histories[sid].extend(rng.randrange(32000) for _ in range(200))
        call = Call(sid, index[sid], models[int(sid[1:]) % 3], prompt, 64, 64, arrival_s=now)
        history = prompt.extend(rng.randrange(32000) for _ in range(64))
        prompt.block_hashes(16, 0)  # token generation is the client's cost, not the router's
        t0 = time.perf_counter()
        inst, _, _ = core.place(call, 64, history, now)
        t1 = time.perf_counter()
        before = len(inst.running)
        inst.schedule(now)
        t2 = time.perf_counter()
        admitted = max(1, len(inst.running) - before)  # a slot opening admits its whole queue
        per_call = (t2 - t1) / admitted
        samples.append((t1 - t0 + per_call, t1 - t0, per_call, t2 - t1))
        for req in drain(inst, now):
            core.on_finished(req)
        core.event(call.session, EventKind.TOOL_START, 0.3, now)
        histories[sid] = history
        index[sid] += 1
        now += 0.001
    return {
        "instances": args.instances,
        "sessions": args.sessions,
        "decisions": args.decisions,
        "policy": args.policy,
        "pack_slack": args.pack_slack,
        "gc_freeze": args.gc_freeze,
        **_stats("decision", [s[0] for s in samples]),
        **_stats("route", [s[1] for s in samples]),
        **_stats("admit", [s[2] for s in samples]),
        **_stats("schedule", [s[3] for s in samples]),
    }


def _stats(name: str, values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {
        f"{name}_median_us": statistics.median(values) * 1e6,
        f"{name}_p99_us": values[int(0.99 * (len(values) - 1))] * 1e6,
        f"{name}_max_us": values[-1] * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=64, help="instances (TP8 H200 each)")
    p.add_argument("--sessions", type=int, default=10_000, help="live sessions")
    p.add_argument("--decisions", type=int, default=2_000, help="timed decisions")
    p.add_argument("--prompt-tokens", type=int, default=2_000, help="first prompt length")
    p.add_argument("--policy", default="talaria", help="policy whose router and admission run")
    p.add_argument(
        "--pack-slack",
        type=float,
        default=0.0,
        help="the policy's pack_slack (a call joins its model's batch within 1 + this of the "
        "least charge; the search then views every instance that may be within it)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument(
        "--gc-freeze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gc.freeze() the live state before timing (--no-gc-freeze: leave the "
        "collector as it is; its full collections then show up in the p99)",
    )
    args = p.parse_args()
    result = measure(args)
    table = Table(
        title=f"{result['policy']}: {result['sessions']:,} live sessions, "
        f"{result['instances']} instances, {result['decisions']:,} timed decisions",
        title_justify="left",
    )
    for col in ("part", "median us", "p99 us", "max us"):
        table.add_column(col, justify="left" if col == "part" else "right")
    parts = (
        ("route (place)", "route"),
        ("admit, per admitted call", "admit"),
        ("route + admit", "decision"),
        ("whole schedule() call", "schedule"),
    )
    for label, key in parts:
        table.add_row(
            label,
            f"{result[f'{key}_median_us']:.0f}",
            f"{result[f'{key}_p99_us']:.0f}",
            f"{result[f'{key}_max_us']:.0f}",
        )
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
