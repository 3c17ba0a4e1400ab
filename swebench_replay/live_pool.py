"""The serverless pool in miniature, for real, with the simulator's prediction beside it.

What :mod:`~talaria.swebench_replay.load_sweep` simulates on 8 or 64 H200 instances, played
here in real time on this machine: ``instances`` instances of the embedded engine in one
process, a catalog of small models (:data:`LIVE_MODELS`: SmolLM2-135M's real weights and
seven random-weight models of four sizes) with Zipf popularity, and open-loop Poisson
arrivals of real trace sessions (:func:`~talaria.swebench_replay.open_loop.draw_arrivals`,
the test part) whose token counts and tool gaps are scaled down so that a run takes
minutes. Each instance's host weight budget holds only part of the catalog: the rest starts
on disk, and a cold start reads the model's file for real
(:class:`~talaria.engine.weight_files.WeightFiles`, out of the page cache), priced in the
prediction at this machine's calibrated disk rate.

For each policy the same arrivals are played on a fresh cluster (the live replay's player,
:mod:`~talaria.swebench_replay.live_replay`), then simulated on the same cluster
configuration priced by the same calibration; the document holds both and the simulator's
error on each figure. The policies run at their defaults: the miniature measures the
simulator's fidelity on a pool, it does not rank policies (the tuned comparisons are the
simulated sweeps').
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import anyio
import attrs
import torch

from talaria.calibration.cache import CalibrationMode
from talaria.config import PolicyConfig
from talaria.engine.runner import EngineRunner
from talaria.engine.threads import in_own_thread
from talaria.engine.weight_files import WeightFiles
from talaria.errors import BadRequest
from talaria.sim.pool_catalog import DEFAULT_ZIPF_S, PoolCatalog, zipf_probabilities
from talaria.swebench_replay.live_replay import (
    NO_HOOKS,
    EmbeddedOptions,
    ReplayHooks,
    _calibration,
    _cluster,
    _load,
    _play,
    _predicted,
    _warm_up,
    schedule_doc,
    step_breakdown,
)
from talaria.swebench_replay.metrics import check_conservation, policy_summary
from talaria.swebench_replay.open_loop import (
    ArrivalPattern,
    OpenLoad,
    build_load,
    check_rate,
    draw_arrivals,
    trace_sessions,
)
from talaria.swebench_replay.split import Part

LIVE_MODELS: Final = (
    "smollm2-135m",
    "qwen2-tiny-dummy",
    "llama-mini-dummy",
    "smollm2-tiny-dummy",
    "smollm2-360m-dummy",
    "qwen2-mini-dummy",
    "agent-tiny-dummy",
    "qwen2.5-0.5b-dummy",
)
"""The live catalog, most popular first: 2.07 GB of bfloat16 weights in four sizes (6 MB,
31 MB, 0.27 and 0.72 GB, 0.99 GB)."""


@attrs.frozen
class LivePool:
    """One miniature run (module docstring). Defaults: 4 instances of 1.6 GB device and
    1.6 GB host memory (62% for weights: 0.99 GB, the largest model's size; the rest is the
    host KV tier), so of the catalog's 2.07 GB only 0.35 GB start on host and the 0.72 GB
    and 0.99 GB models start on disk; 16 sessions at 0.1 per second, tokens scaled by 0.02
    (a 20K-token prompt becomes 400) and tool gaps by 0.1."""

    policies: tuple[PolicyConfig, ...]
    models: tuple[str, ...] = LIVE_MODELS
    instances: int = 4
    sessions: int = 16
    rate_per_s: float = 0.1
    zipf_s: float = DEFAULT_ZIPF_S
    token_scale: float = 0.02
    gap_scale: float = 0.1
    seed: int = 0
    device_memory_bytes: int = 1_600_000_000
    host_memory_bytes: int = 1_600_000_000
    host_weight_share: float = 0.62
    calibration: CalibrationMode = CalibrationMode.AUTO
    trace: Path | None = None

    def __attrs_post_init__(self) -> None:
        check_rate(self.rate_per_s)
        if isinstance(self.sessions, bool) or not isinstance(self.sessions, int):
            raise BadRequest(f"sessions must be an integer, got {self.sessions!r}")
        if self.sessions < 1:
            raise BadRequest(f"a live pool needs at least one session, got {self.sessions}")
        if not 0 < self.token_scale <= 1 or not 0 < self.gap_scale <= 1:
            raise BadRequest("token_scale and gap_scale must lie in (0, 1]")

    def options(self) -> EmbeddedOptions:
        """The embedded replay's options for this pool (instances, budgets, calibration)."""
        return EmbeddedOptions(
            self.policies,
            instances=self.instances,
            models=self.models,
            device_memory_bytes=self.device_memory_bytes,
            host_memory_bytes=self.host_memory_bytes,
            host_weight_share=self.host_weight_share,
            gap_scale=self.gap_scale,
            calibration=self.calibration,
        )


def run_live_pool(pool: LivePool, disk: Path, hooks: ReplayHooks = NO_HOOKS) -> dict[str, Any]:
    """Play ``pool`` for every policy and predict each run; the document (module docstring).
    ``disk`` is the folder of the weight files (written here first). Reports through
    ``hooks``; sets the process's torch threads to each instance's share while it runs."""
    options = pool.options()
    threads = torch.get_num_threads()
    torch.set_num_threads(options.threads_per_instance(threads))
    try:
        return _run(pool, options, disk, hooks)
    finally:
        torch.set_num_threads(threads)


def _run(
    pool: LivePool, options: EmbeddedOptions, disk: Path, hooks: ReplayHooks
) -> dict[str, Any]:
    say, started = hooks.say, time.monotonic()
    say(f"loading {len(options.models)} models ({options.dtype})")
    bare, host = in_own_thread(lambda: _load(options))
    calibration = _calibration(options, bare, host, say) if options.on_cpu else None
    hardware = {"cpu": calibration.profile} if calibration is not None else {}
    specs = [m.arch.to_spec(n, options.dtype, source=m.source) for n, m in bare.items()]
    catalog = PoolCatalog(tuple(specs), pool.zipf_s, zipf_probabilities(len(specs), pool.zipf_s))
    load = _arrivals(pool, catalog)
    say(f"writing the weight files to {disk}")
    files = WeightFiles(disk)
    for name, flat in host.items():
        files.write(name, flat)
    say("warming up every model once")
    in_own_thread(lambda: _warm_up(bare, host, options))
    tool_s = {s.session_id: sum(c.tool_seconds for c in s.calls) for s in load.scripts}
    policies: dict[str, Any] = {}
    for policy in options.policies:
        say(f"playing {pool.sessions} arrivals under {policy.name} in real time")
        cluster = _cluster(options, bare, host, policy, hardware, files)
        _keep_starting_copies(host, cluster)
        reads, read_bytes, stopped = files.reads, files.bytes_read, files.stopped_reads
        result, steps = anyio.run(
            _play, cluster, load.scripts, policy.name, hooks.tick(policy.name)
        )
        check_conservation(result, load.n_calls, tool_s)
        engines = [r for r in cluster.runners.values() if isinstance(r, EngineRunner)]
        hooks.done(policy.name, result)
        measured = policy_summary(result) | {
            "cold_loads": int(result.counters.get("cold_loads", 0)),
            "scale_to_zero": int(result.counters.get("scale_to_zero", 0)),
            "disk_reads": files.reads - reads,
            "disk_bytes_read": files.bytes_read - read_bytes,
            # reads stopped (their copy dropped), switches that waited on a stage's read, and
            # reads a switch did on the step thread for want of one
            "disk_reads_stopped": files.stopped_reads - stopped,
            "waited_reads": sum(r.waited_reads for r in engines),
            "sync_reads": sum(r.sync_reads for r in engines),
        }
        measured |= _slot_closes(result.counters)
        fidelity, predicted = _predicted(cluster, policy, load.scripts, hardware, measured)
        policies[policy.name] = {
            "measured": measured,
            "predicted": policy_summary(predicted)
            | {
                "cold_loads": int(predicted.counters.get("cold_loads", 0)),
                "scale_to_zero": int(predicted.counters.get("scale_to_zero", 0)),
            }
            | _slot_closes(predicted.counters),
            "fidelity": fidelity,
            "step_costs": step_breakdown(steps),  # per step kind: measured vs priced seconds
            "schedules": {"measured": schedule_doc(result), "predicted": schedule_doc(predicted)},
        }
        del cluster
        gc.collect()
    return _document(pool, options, catalog, load, files, calibration, policies, started)


def _slot_closes(counters: Mapping[str, int]) -> dict[str, int]:
    """Slots that started closing, by reason (``slot_closes_<reason>``)."""
    return {k: int(v) for k, v in counters.items() if k.startswith("slot_closes_")}


def _arrivals(pool: LivePool, catalog: PoolCatalog) -> OpenLoad:
    sessions, path = trace_sessions(pool.trace, Part.TEST)
    draws = draw_arrivals(
        sessions, catalog, pool.sessions, pool.rate_per_s, ArrivalPattern(), pool.seed,
        pool.token_scale,
    )  # fmt: skip
    return build_load(
        draws, pool.seed, trace_path=path, token_scale=pool.token_scale, gap_scale=pool.gap_scale
    )


def _keep_starting_copies(host: dict[str, torch.Tensor], cluster: Any) -> None:
    """Drop the loader's host copies of the models no instance starts with on host: from
    here on, host memory holds what the arenas hold (the rest is read from disk)."""
    starting = {m for inst in cluster.core.instances.values() for m in inst.layout.host_models}
    for name in set(host) - starting:
        del host[name]
    gc.collect()


def _document(
    pool: LivePool,
    options: EmbeddedOptions,
    catalog: PoolCatalog,
    load: OpenLoad,
    files: WeightFiles,
    calibration: Any,
    policies: dict[str, Any],
    started: float,
) -> dict[str, Any]:
    return {
        "substrate": "embedded (live, in this process)",
        "instances": [attrs.asdict(s) for s in options.instance_specs()],
        "torch_threads_per_instance": torch.get_num_threads(),
        "catalog": {
            "models": [m.name for m in catalog.models],
            "zipf_s": catalog.zipf_s,
            "probabilities": list(catalog.probabilities),
            "weight_bytes": {m.name: m.weight_bytes for m in catalog.models},
        },
        "workload": {
            "pattern": "poisson",
            "rate_per_s": pool.rate_per_s,
            "sessions": pool.sessions,
            "calls": load.n_calls,
            "seed": pool.seed,
            "part": "test",
            "token_scale": pool.token_scale,
            "gap_scale": pool.gap_scale,
            "source": load.source,
            "arrivals": [
                {"session": d.session_id, "model": d.model, "start_s": d.start_s}
                for d in load.draws
            ],
        },
        "disk": {"folder": str(files.folder), "page_cache_dropped": files.cold_reads},
        "calibration": calibration.describe() if calibration is not None else None,
        "policies": policies,
        "wall_s": time.monotonic() - started,
    }
