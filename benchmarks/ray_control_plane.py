"""The control plane's limit: how many decisions per second one router process sustains
with its instances in Ray actors that execute no model.

Each instance is a real :class:`~talaria.backends.ray.executor.RayExecutor` over a real
instance core (router, admission, slot policy, KV accounting all run), but its actor is a
``NullWorker``: it takes the same wire (prompts once, then plans and block tables) and
answers one token per sequence whose prompt is complete, without any tensor work. So every
second the router spends is the control plane's: routing a call, planning a schedule,
pickling it to the actor and back, committing it. The same load runs against the same
``NullWorker`` called in process (no Ray) to separate Ray's round trip from the policy's
own cost.

Load: ``--sessions`` closed-loop agent sessions (no tool gaps, so the load never waits),
``--calls`` calls each, prompts of 2,000 tokens growing by 300 per call, 32-token answers,
one tiny model (``smollm2-tiny-dummy``'s shape) on every instance. Reported per instance
count: schedules (decisions) per second over all instances, routed calls per second,
generated tokens per second, and the mean round trip to the actor per schedule::

    .venv/bin/python benchmarks/ray_control_plane.py \
        --json benchmarks/results/ray_control_plane.json

A few minutes on 2 cores (the router, Ray's own processes and the actors share them: on a
real head node the router has its cores to itself, so these are lower bounds).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import anyio
import ray
import torch
from rich.console import Console
from rich.table import Table

from talaria.backends.embedded import load_catalog_model
from talaria.backends.ray.actor import WorkerInfo
from talaria.backends.ray.executor import RayExecutor
from talaria.backends.ray.wire import WireResult, WireSchedule
from talaria.config import ClusterConfig, InstanceSpec
from talaria.core.cluster import ClusterCore
from talaria.cost import cluster_estimators
from talaria.executor import Layout
from talaria.generation import SamplingParams, StopChecker
from talaria.memory.kv import CallKey
from talaria.policy.baselines import POLICIES
from talaria.runtime.live import LiveCluster
from talaria.runtime.streams import Failed, Finished
from talaria.types import DEFAULT_TENANT, SessionKey, TokenSeq

MODEL = "smollm2-tiny-dummy"
GB = 10**9
PROMPT, GROWTH, ANSWER = 2000, 300, 32


class NullWorker:
    """An instance worker that executes nothing: one token (id 7) per sequence whose
    prompt the step completes, and per decode."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.prompt_len: dict[CallKey, int] = {}

    def attach(self, layout: Layout) -> WorkerInfo:
        self.prompt_len.clear()
        return WorkerInfo("null", platform.node(), 0, layout, {MODEL: self.vocab}, {}, 0)

    def ping(self) -> str:
        return "null"

    def execute(self, wire: WireSchedule) -> WireResult:
        for key in wire.drop:
            self.prompt_len.pop(key, None)
        for new in wire.new:
            self.prompt_len[new.key] = len(new.prompt)
        step = wire.step
        if step is None:
            return WireResult(())
        done = [(k, 7) for k, n, start in step.prefill if start + n == self.prompt_len[k]]
        return WireResult(tuple(done) + tuple((k, 7) for k in step.decode))


class _Local:
    """A Ray-actor-like handle over an object in this process (``.remote`` runs the method
    and puts its result in the object store, so ``ray.get`` finds it)."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> _Remote:
        return _Remote(getattr(self._target, name))


class _Remote:
    def __init__(self, method: Any) -> None:
        self._method = method

    def remote(self, *args: Any) -> Any:
        return ray.put(self._method(*args))


def build(instances: int, on_ray: bool) -> tuple[ClusterCore, dict[str, RayExecutor]]:
    arch = load_catalog_model(MODEL, torch.bfloat16, weights=False).arch
    spec = arch.to_spec(MODEL, torch.bfloat16)
    specs = tuple(
        InstanceSpec(
            name=f"cpu-{i}",
            hardware="cpu",
            device_memory_bytes=4 * GB,
            host_memory_bytes=8 * GB,
            block_size=16,
            memory_utilization=0.9,
        )
        for i in range(instances)
    )
    cluster = ClusterConfig([spec], specs)
    core = ClusterCore(cluster, POLICIES["talaria"], cluster_estimators(cluster))
    runners: dict[str, RayExecutor] = {}
    remote_worker = ray.remote(NullWorker)
    for name, inst in core.instances.items():
        layout = inst.layout
        handle = (
            remote_worker.options(num_cpus=0).remote(arch.vocab_size)
            if on_ray
            else _Local(NullWorker(arch.vocab_size))
        )
        info = ray.get(handle.attach.remote(layout))
        runners[name] = RayExecutor(name, layout, handle, info)
    return core, runners


async def drive(core: ClusterCore, runners: dict[str, RayExecutor], sessions: int, calls: int):
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER, ignore_eos=True)
    async with LiveCluster(core, runners, max_calls=100_000) as live:
        started = time.perf_counter()

        async def session(i: int) -> None:
            prompt = TokenSeq(range(i, i + PROMPT))
            for _ in range(calls):
                key = SessionKey(DEFAULT_TENANT, f"s{i}")
                async with live.session(key).lock:
                    _, events = await live.submit(key, MODEL, prompt, params, StopChecker(params))
                    async for ev in events:
                        if isinstance(ev, Failed):
                            raise ev.error
                        if isinstance(ev, Finished):
                            break
                prompt = prompt.extend([7] * ANSWER + list(range(1, GROWTH - ANSWER + 1)))

        async with anyio.create_task_group() as tg:
            for i in range(sessions):
                tg.start_soon(session, i)
        wall = time.perf_counter() - started
        steps = sum(r.steps for r in runners.values())
        return {
            "wall_s": round(wall, 2),
            "schedules": steps,
            "schedules_per_s": round(steps / wall, 1),
            "calls_per_s": round(sessions * calls / wall, 1),
            "tokens_per_s": round(sessions * calls * ANSWER / wall, 1),
            "round_trip_ms": round(
                1000 * sum(r.wire_s for r in runners.values()) / max(1, steps), 3
            ),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", default="1,2,4,8", help="instance counts to measure")
    ap.add_argument("--sessions", type=int, default=64, help="concurrent sessions")
    ap.add_argument("--calls", type=int, default=8, help="calls per session")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args()
    counts = [int(x) for x in args.instances.split(",")]
    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    rows: list[dict[str, Any]] = []
    console = Console()
    try:
        for n in counts:
            for on_ray in (True, False):
                core, runners = build(n, on_ray)
                row = anyio.run(drive, core, runners, args.sessions, args.calls)
                row = {"instances": n, "actors": "ray" if on_ray else "in process", **row}
                console.print(row)
                rows.append(row)
    finally:
        ray.shutdown()
    table = Table(title="control plane: one router process, actors that execute nothing")
    for col in ("instances", "actors", "schedules/s", "calls/s", "tokens/s", "round trip ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["instances"]),
            r["actors"],
            f"{r['schedules_per_s']:,.0f}",
            f"{r['calls_per_s']:,.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['round_trip_ms']:.2f}",
        )
    console.print(table)
    if args.json is not None:
        doc = {
            "command": "benchmarks/ray_control_plane.py",
            "machine": {"cpus": torch.get_num_threads(), "node": platform.node()},
            "load": {
                "sessions": args.sessions,
                "calls": args.calls,
                "prompt": PROMPT,
                "growth": GROWTH,
                "answer": ANSWER,
            },
            "rows": rows,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
