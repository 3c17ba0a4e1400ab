"""The router's search alone, timed on one frozen pool: precise enough to compare versions.

``benchmarks/policy_overhead.py`` times decisions inside a changing pool, and on a shared
machine its run-to-run noise (10-30% in the route's median) hides a change of a few
percent. ``search`` (``talaria.policy.router``) is pure, so this benchmark brings
``--sessions`` sessions live on ``--instances`` TP8 instances (as ``policy_overhead`` does),
freezes the pool, and times ``--calls`` continuation calls of random sessions, each searched
``--repeats`` times. ``--compare NAME=PATH`` (again for more) loads another version of the
router module from a file (e.g. a ``git worktree`` of an older commit) and times its
``search`` on the same candidates, interleaved in random order call by call, so every
version sees the same state, caches and machine; the versions must choose the same
instance for every call.

Reports median, p90 and mean microseconds per search. The hash seed of the process moves
the pool's state, so compare versions within one run, not across runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the ``benchmarks`` modules import from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import importlib.util
import random
import statistics
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from rich.console import Console
from rich.progress import track
from rich.table import Table

from benchmarks.policy_overhead import bring_live, build
from talaria.errors import BadRequest
from talaria.policy import router
from talaria.sim.catalog import PAPER_MODELS
from talaria.types import Call


def load_router(name: str, path: Path) -> ModuleType:
    """The router module in ``path`` (another version of ``talaria/policy/router.py``)."""
    if not path.is_file():
        raise BadRequest(f"--compare {name}={path}: no such file")
    spec = importlib.util.spec_from_file_location(f"_router_{name}", path)
    if spec is None or spec.loader is None:
        raise BadRequest(f"--compare {name}={path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def versions(specs: list[str]) -> dict[str, Callable[..., Any]]:
    """``search`` of this checkout ("this") and of each ``NAME=PATH``."""
    out: dict[str, Callable[..., Any]] = {"this": router.search}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or name in out:
            raise BadRequest(f"--compare {spec!r}: want NAME=PATH with a new NAME")
        out[name] = load_router(name, Path(path)).search
    return out


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    searches = versions(args.compare or [])
    rng = random.Random(args.seed)
    core = build(args.instances, args.policy, args.pack_slack)
    models = [m.name for m in PAPER_MODELS]
    histories, now = bring_live(core, args.sessions, args.prompt_tokens, rng)
    times: dict[str, list[float]] = {name: [] for name in searches}
    for _ in track(range(args.calls), description="timed searches"):
        sid = f"s{rng.randrange(args.sessions)}"
        prompt = histories[sid].extend(rng.randrange(32000) for _ in range(200))
        call = Call(sid, 1, models[int(sid[1:]) % 3], prompt, 64, 64, arrival_s=now)
        prompt.block_hashes(16, 0)  # hashed once, as the router finds it
        info = core.sessions[call.session]
        candidates = [inst.estimates for inst in core.instances.values()]
        kw = {
            "last_instance": info.last_instance,
            "known_tokens": info.known_tokens,
            "expected_output": info.last_output,
            "calls_left": core.lengths.expected_left(info.calls),
        }
        for _ in range(args.repeats):
            order = list(searches)
            rng.shuffle(order)
            chosen = set()
            for name in order:
                t0 = time.perf_counter()
                decision = searches[name](candidates, call, now, core.policy, **kw)
                times[name].append(time.perf_counter() - t0)
                chosen.add(decision.instance)
            if len(chosen) > 1:
                raise SystemExit(f"the versions chose differently for {call.key}: {chosen}")
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=64, help="instances (TP8 H200 each)")
    p.add_argument("--sessions", type=int, default=3_000, help="live sessions")
    p.add_argument("--calls", type=int, default=200, help="continuation calls searched")
    p.add_argument("--repeats", type=int, default=5, help="searches of each call, per version")
    p.add_argument("--prompt-tokens", type=int, default=2_000, help="first prompt length")
    p.add_argument("--policy", default="talaria", help="the policy whose search runs")
    p.add_argument("--pack-slack", type=float, default=0.0, help="the policy's pack_slack")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compare",
        action="append",
        metavar="NAME=PATH",
        help="another router.py to time beside this checkout's (again for more)",
    )
    args = p.parse_args()
    try:
        times = measure(args)
    except BadRequest as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = Table(
        title=f"search, {args.instances} instances, {args.sessions:,} sessions, "
        f"{args.calls} calls x {args.repeats}, pack slack {args.pack_slack:g}",
        title_justify="left",
    )
    for col in ("version", "median us", "p90 us", "mean us"):
        table.add_column(col, justify="left" if col == "version" else "right")
    for name, ts in times.items():
        ts.sort()
        table.add_row(
            name,
            f"{statistics.median(ts) * 1e6:.1f}",
            f"{ts[int(0.9 * (len(ts) - 1))] * 1e6:.1f}",
            f"{statistics.mean(ts) * 1e6:.1f}",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
