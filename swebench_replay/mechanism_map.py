"""Where each mechanism pays: every tuned policy and every ablation over a map of settings.

A *point* of the map is a setting (memory pressure, load, instances, tool-gap length); at
each point every policy is tuned on the tune part (:mod:`.tuning`) and compared on the test
part over seeds (:mod:`.compare`). A mechanism's effect at a point is the paired ratio of
the ablation without it to ``talaria`` (SCT p50 and p95, geometric mean over the seeds with
its 95% interval): 1.3 means talaria finishes sessions 1.3x sooner with it than without.

* session-prefill: ``talaria-no-sp``; host KV: ``talaria-no-hostkv``; staging:
  ``talaria-no-staging``; reservations: ``talaria-no-reserve``; the slot order:
  ``talaria-no-slot-order``; hints: talaria with clients that send none.

The points vary one thing at a time around the paper's setting (30 sessions, about 960
calls, one TP8 server, as much KV as the hardware leaves, the traces' tool gaps), plus the
combinations where the session mechanisms are meant to pay (memory pressure with long
gaps, several instances with pressure or long gaps). The last points move to the other end
of the hardware: the embedded replay's CPU server (``server="cpu"``: SmolLM2-135M,
Qwen2.5-0.5B and Llama-3.2-1B in a 3 GB device budget that holds one model and 0.23 GB of
KV, the workload of ``talaria replay --substrate embedded``, priced by the shipped ``cpu``
profile), where KV is scarce and recomputing it is slow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from talaria.config import ClusterConfig, PolicyConfig
from talaria.engine import catalog
from talaria.engine.catalog import DEFAULT_MODELS
from talaria.engine.loader import gguf_arch, smollm2_gguf
from talaria.policy.baselines import TALARIA
from talaria.sim.catalog import paper_cluster
from talaria.swebench_replay import tuning
from talaria.swebench_replay.compare import comparison_runs as _comparison_runs
from talaria.swebench_replay.compare import headline, summarize
from talaria.swebench_replay.live_replay import EmbeddedOptions
from talaria.swebench_replay.pressure import with_kv_fraction
from talaria.swebench_replay.runs import Outcome, Setting, WorkloadSpec, execute_all
from talaria.swebench_replay.setup import playable_sessions
from talaria.swebench_replay.split import Part

MECHANISMS: Mapping[str, str] = {
    "session-prefill": "talaria-no-sp",
    "host KV": "talaria-no-hostkv",
    "staging": "talaria-no-staging",
    "reservations": "talaria-no-reserve",
    "slot order": "talaria-no-slot-order",
    "hints": "talaria-no-hints",
}
CALLS_PER_SESSION = 32
CPU_CALLS_PER_SESSION = 8  # the embedded replay's 96 calls over 12 sessions
CPU_TOKEN_SCALE = 1 / 8  # the embedded replay's (SmolLM2's 8K context bounds the prompts)
CPU_CONTEXT = 8192


@attrs.frozen
class Point:
    """One setting of the map. ``kv_fraction`` None: the KV the hardware leaves."""

    label: str
    kv_fraction: float | None = None
    sessions: int = 30
    instances: int = 1
    gap_scale: float = 1.0
    server: str = "h200"  # "h200": the paper-scale models on TP8 servers; "cpu": see above

    @property
    def servers(self) -> int:
        return 1 if self.instances <= 2 else self.instances // 2

    @property
    def calls_per_session(self) -> int:
        return CPU_CALLS_PER_SESSION if self.server == "cpu" else CALLS_PER_SESSION

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


POINTS: tuple[Point, ...] = (
    Point("paper setting"),
    Point("KV 1.0x working set", kv_fraction=1.0),
    Point("KV 0.5x", kv_fraction=0.5),
    Point("KV 0.25x", kv_fraction=0.25),
    Point("KV 0.1x", kv_fraction=0.1),
    Point("gaps x4", gap_scale=4.0),
    Point("gaps x16", gap_scale=16.0),
    Point("KV 0.25x, gaps x4", kv_fraction=0.25, gap_scale=4.0),
    Point("KV 0.25x, gaps x16", kv_fraction=0.25, gap_scale=16.0),
    Point("15 sessions", sessions=15),
    Point("60 sessions", sessions=60),
    Point("2 instances", instances=2),
    Point("2 instances, KV 0.25x", instances=2, kv_fraction=0.25),
    Point("2 instances, gaps x16", instances=2, gap_scale=16.0),
    Point("4 instances (2 servers), 60 sessions", instances=4, sessions=60),
    Point("CPU server (embedded default)", server="cpu", sessions=12),
    Point("CPU server, gaps x4", server="cpu", sessions=12, gap_scale=4.0),
    Point("CPU server, 24 sessions", server="cpu", sessions=24),
    Point("CPU, 2 instances, 24 sessions", server="cpu", sessions=24, instances=2),
)
QUICK = (POINTS[0], POINTS[3], POINTS[8], POINTS[11])


def specs(point: Point, synthetic: bool = False) -> tuple[WorkloadSpec, WorkloadSpec]:
    """(tune part, test part) workloads of a point. A point that asks for more sessions
    than the tune part holds (the bundled traces' tune part has 39 that fit) is tuned on all
    it holds, at the same calls per session: its knobs come from the nearest load the tune
    part can play."""
    test = WorkloadSpec(
        synthetic=synthetic,
        part=Part.TEST,
        sessions=point.sessions,
        calls=point.sessions * point.calls_per_session,
    )
    if point.server == "cpu":
        test = attrs.evolve(
            test, models=DEFAULT_MODELS, max_context=CPU_CONTEXT, token_scale=CPU_TOKEN_SCALE
        )
    tune = attrs.evolve(test, part=Part.TUNE)
    room = (
        None
        if synthetic
        else playable_sessions(None, Part.TUNE, tune.max_context, tune.token_scale)
    )
    if room is not None and room < tune.sessions:
        tune = attrs.evolve(tune, sessions=room, calls=room * point.calls_per_session)
    return tune, test


def cpu_cluster(instances: int) -> ClusterConfig:
    """The embedded replay's cluster (``EmbeddedOptions``' instances, the default models'
    architectures in bfloat16), without loading a weight."""
    specs = []
    for name in DEFAULT_MODELS:
        e = catalog.entry(name)
        arch = gguf_arch(smollm2_gguf()) if e.config is None else catalog.arch_of(e)
        specs.append(arch.to_spec(name, torch.bfloat16, source=e.source.value))
    options = EmbeddedOptions((TALARIA,), instances=instances)
    return ClusterConfig(specs, options.instance_specs())


def setting(point: Point, tune_spec: WorkloadSpec) -> Setting:
    """The simulated setting of a point (memory pressure sized on the tune part)."""
    if point.server == "cpu":
        cluster = cpu_cluster(point.instances)
    else:
        cluster = paper_cluster(point.instances, point.servers)
    if point.kv_fraction is not None:
        cluster = with_kv_fraction(cluster, tune_spec, point.kv_fraction)
    return Setting(cluster, gap_scale=point.gap_scale)


def mechanism_effects(policies: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Each mechanism's paired ratio (its ablation's SCT over talaria's) at p50 and p95."""
    return {
        mech: dict(policies[ablation]["vs_talaria"])
        for mech, ablation in MECHANISMS.items()
        if ablation in policies and "vs_talaria" in policies[ablation]
    }


def run_point(
    point: Point,
    policies: Sequence[PolicyConfig],
    seeds: Sequence[int],
    tune_seeds: Sequence[int],
    jobs: int,
    synthetic: bool = False,
    on_done: Callable[[Outcome], None] | None = None,
) -> dict[str, Any]:
    """One row of the map: the point, every policy's knobs and figures, the mechanisms'
    effects and talaria against the best tuned per-request baseline."""
    tune_spec, test_spec = specs(point, synthetic)
    where = setting(point, tune_spec)
    key = tuning.cache_key(tune_spec, where, policies, tune_seeds)
    doc = tuning.read_cached(key)
    if doc is None:
        runs = tuning.tuning_runs(tune_spec, where, policies, tune_seeds)
        chosen = tuning.choose(policies, tune_seeds, execute_all(runs, jobs, on_done))
        doc = tuning.to_document(chosen, key, tune_seeds)
        tuning.write_cached(doc)
    tuned = tuning.tuned_policies(policies, tuning.from_document(doc))
    runs = _comparison_runs(test_spec, where, tuned, seeds, references=False)
    entries = summarize(seeds, execute_all(runs, jobs, on_done))
    return {
        "point": point.to_json(),
        "policies": {
            name: {
                "sct_p50_s": e["sct_p50_s"],
                "sct_p95_s": e["sct_p95_s"],
                "sct_p50_s_ci95": e["sct_p50_s_ci95"],
                "sct_p95_s_ci95": e["sct_p95_s_ci95"],
                "knobs": e.get("knobs"),
                "vs_talaria": e.get("vs_talaria"),
            }
            for name, e in entries.items()
        },
        "mechanisms": mechanism_effects(entries),
        "comparison": headline(entries),
    }


def runs_per_point(policies: Sequence[PolicyConfig], seeds: int, tune_seeds: int) -> int:
    """Simulations a point takes when nothing is cached (for a progress bar)."""
    from talaria.policy.knobs import grid

    tune = sum(len(grid(p)) for p in policies) * tune_seeds
    compare = (len(policies) + (1 if any(p.name == TALARIA.name for p in policies) else 0)) * seeds
    return tune + compare
