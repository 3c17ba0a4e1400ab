"""Engine microbenchmarks and the fit that turns them into the ``cpu`` profile's step costs.

The simulator prices a step as ``max(FLOPs / flop rate, bytes read / bandwidth) + a fixed
overhead``. Raw machine rates (:mod:`talaria.calibration.machine`: a square matmul, a
memcpy) are upper bounds the engine does not reach, so this module measures the embedded
engine itself through its serving path, stepped as the live runtime steps it (plan and
commit on an event loop, ``EngineRunner.execute`` on a worker thread), on each model
(:func:`measure_model`), and :func:`fit` turns the measurements into:

- decode: the time of a batch-1 decode step on a short context, per model, fitted as
  ``overhead + weight_bytes / bandwidth`` (least squares over the models);
- prefill: a ``prefill_tokens``-token prefill per model, fitted as ``overhead + FLOPs /
  flop rate`` with the overhead from the decode fit;
- stage contention: decode steps alone and beside the runner's background stage copy, and
  the copy's rate idle and beside them (:func:`_stage_contention`);
- step grid (:mod:`talaria.calibration.grid`, when the bench has one): bare forwards over
  batch x context and chunk x cached prefix on a worker thread, fitted as the additive
  step prices (:mod:`talaria.calibration.linear`), and a step beside a second engine;
- attention: decode steps of ``attention_batch`` sequences at short and long contexts give
  the KV read rate (extra time per extra context byte); a ``chunk``-token prefill chunk
  from an empty cache and after a ``long_ctx``-token cached prefix gives the attention FLOP
  rate (extra time, less the extra KV reads, per extra attention FLOP); batch 8 against
  batch 1 gives the time each decoding sequence adds to a step.

:func:`measure_engine` returns the ``engine`` section of a ``cpu_profile.json`` document,
which :func:`talaria.cost.hardware.cpu_profile_from_dict` prefers to the raw rates. It takes
models already loaded (a replay's weights are reused, not loaded again) and never sees replay
results. ``benchmarks/engine_calibration.py`` runs it for the shipped profile;
:mod:`talaria.calibration.calibrate` runs it where Talaria runs. The sizes are an
:class:`~talaria.calibration.plan.EngineBench` (tests pass tiny ones).
"""

from __future__ import annotations

import datetime as dt
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import numpy as np
import torch

from talaria.calibration.grid import StepPoint, measure_co_run, measure_grid, points_json
from talaria.calibration.linear import cross_validate, fit_steps, residuals
from talaria.calibration.plan import EngineBench
from talaria.config import InstanceSpec, ModelSpec
from talaria.core.instance import InstanceCore
from talaria.cost import estimator_for
from talaria.cost.step_shape import StepShape
from talaria.engine.kernels import MAX_SMALL_M, optional_decode_kernel
from talaria.engine.loader import LoadedModel
from talaria.engine.runner import EngineRunner
from talaria.engine.staging import BackgroundCopy
from talaria.engine.threads import in_own_thread
from talaria.errors import ConfigError
from talaria.policy.baselines import POLICIES
from talaria.runtime.local import LocalInstance
from talaria.types import Call, TokenSeq


def _instance(bench: EngineBench) -> InstanceSpec:
    return InstanceSpec(
        name="cal-0",
        hardware="cpu",
        device_memory_bytes=bench.device_memory_bytes,
        host_memory_bytes=bench.host_memory_bytes,
        memory_utilization=0.9,
    )


class _Probe:
    """One model on a fresh single-model instance, random prompts for it, and steps run the
    way the live runtime runs them (``LiveCluster``: plan and commit on the event loop's
    thread, execute on a worker thread, the only thread whose OpenMP team is alive:
    :mod:`talaria.engine.threads`)."""

    def __init__(
        self, local: LocalInstance[EngineRunner], runner: EngineRunner, name: str, vocab: int
    ) -> None:
        self.local, self.runner, self.name, self.now = local, runner, name, 0.0
        self._rng = np.random.default_rng(0)
        self._vocab = vocab
        self._limiter = anyio.CapacityLimiter(1)

    def ids(self, n: int) -> TokenSeq:
        return TokenSeq(self._rng.integers(1, self._vocab, size=n).tolist())

    async def run(self, call: Call) -> None:
        """Serve ``call`` alone to its end (output discarded)."""
        self.local.submit(call, self.now)
        while not self.local.idle:
            await self._tick()
        self.local.take_output(call.key)

    async def timed(self, call: Call) -> float:
        """Seconds to serve ``call`` alone."""
        t0 = time.perf_counter()
        await self.run(call)
        return time.perf_counter() - t0

    async def decode_step(self, batch: int, ctx: int, steps: int, tag: str) -> float:
        """Median step time of ``batch`` sequences decoding on ``ctx``-token contexts."""
        local, core = self.local, self.local.core
        calls = [Call(f"d{tag}-{i}", 0, self.name, self.ids(ctx), steps + 1) for i in range(batch)]
        for c in calls:
            local.submit(c, self.now)
        while any(r.prefilling for r in core.running.values()) or any(core.waiting.values()):
            await self._tick()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            await self._tick()
            times.append(time.perf_counter() - t0)
        while not local.idle:
            await self._tick()
        for c in calls:
            local.take_output(c.key)
        return statistics.median(times)

    async def _tick(self) -> None:
        local = self.local
        sched = local.core.schedule(self.now)
        work = local.work(sched)
        done = await anyio.to_thread.run_sync(self.runner.execute, work, limiter=self._limiter)
        local.commit(sched, done, self.now)
        self.now += 0.001


async def _timings(probe: _Probe, b: EngineBench) -> dict[str, float]:
    """Every timing of one model (seconds; medians over ``b.reps`` or ``b.decode_steps``)."""
    name = probe.name
    await probe.run(Call("warm", 0, name, probe.ids(64), 2))
    prefill = [
        await probe.timed(Call(f"p{r}", 0, name, probe.ids(b.prefill_tokens), 1))
        for r in range(b.reps)
    ]
    out = {
        "prefill_s": statistics.median(prefill),
        "decode_step_s_batch1": await probe.decode_step(1, b.short_ctx, b.decode_steps, "1"),
        "decode_step_s_batch8": await probe.decode_step(8, b.short_ctx, b.decode_steps, "8"),
        "decode_step_s_short_ctx": await probe.decode_step(
            b.attention_batch, b.short_ctx, b.decode_steps, "a-short"
        ),
        "decode_step_s_long_ctx": await probe.decode_step(
            b.attention_batch, b.long_ctx, b.decode_steps, "a-long"
        ),
    }
    fresh, after = [], []
    for r in range(b.reps):  # a chunk from an empty cache and after a cached prefix
        fresh.append(await probe.timed(Call(f"f{r}", 0, name, probe.ids(b.chunk), 1)))
        prefix = probe.ids(b.long_ctx)
        await probe.run(Call(f"c{r}", 0, name, prefix, 1))
        longer = prefix.extend(probe.ids(b.chunk).tokens())
        after.append(await probe.timed(Call(f"c{r}", 1, name, longer, 1)))
    out["chunk_s_fresh"] = statistics.median(fresh)
    out["chunk_s_after_prefix"] = statistics.median(after)
    return out | await _stage_contention(probe, b)


STAGE_ROUNDS = 3  # alternations of decode steps alone and beside a stage copy


async def _stage_contention(probe: _Probe, b: EngineBench) -> dict[str, float]:
    """Decode steps alone and beside the runner's background stage copy (``BackgroundCopy``:
    the model's own host weights into free KV blocks lent for it, restarted as it ends),
    alternating ``STAGE_ROUNDS`` times on one batch so that drift hits both alike; and the
    copy's rate idle and beside the steps (bytes per second)."""
    runner, local, core = probe.runner, probe.local, probe.local.core
    src = runner.host_weights[probe.name]
    lent = core.kv.lend(min(core.kv.device_free // 2, -(-src.numel() // core.kv.block_bytes)))
    try:
        nbytes = min(src.numel(), len(lent) * core.kv.block_bytes)
        runs = [
            (rows.flatten()[: hi - lo], src[lo:hi])
            for rows, lo, hi in runner._lent_runs(nbytes, lent)
        ]
        copier = BackgroundCopy()
        t0 = time.perf_counter()
        copier.start(probe.name, lent, runs)
        copier.wait()
        idle_s = time.perf_counter() - t0
        per = max(2, b.decode_steps // 3)
        calls = [
            Call(f"stage-{i}", 0, probe.name, probe.ids(b.short_ctx), 2 * STAGE_ROUNDS * per + 2)
            for i in range(b.attention_batch)
        ]
        for c in calls:
            local.submit(c, probe.now)
        while any(r.prefilling for r in core.running.values()) or any(core.waiting.values()):
            await probe._tick()
        alone: list[float] = []
        beside: list[float] = []
        moved, beside_s = 0, 0.0
        for _ in range(STAGE_ROUNDS):
            alone += [await _timed_tick(probe) for _ in range(per)]
            copier.start(probe.name, lent, runs)
            started = time.perf_counter()
            for _ in range(per):
                beside.append(await _timed_tick(probe))
                if copier.done:
                    copier.wait()
                    moved += nbytes
                    copier.start(probe.name, lent, runs)
            moved += copier.copied_bytes
            copier.cancel()
            beside_s += time.perf_counter() - started
        while not local.idle:
            await probe._tick()
        for c in calls:
            local.take_output(c.key)
    finally:
        core.kv.return_lent()
    return {
        "stage_decode_step_s_alone": statistics.median(alone),
        "stage_decode_step_s_beside": statistics.median(beside),
        "stage_B_s_idle": nbytes / idle_s,
        "stage_B_s_beside_decode": moved / beside_s,
    }


async def _timed_tick(probe: _Probe) -> float:
    t0 = time.perf_counter()
    await probe._tick()
    return time.perf_counter() - t0


def _probe_instance(
    name: str,
    model: LoadedModel,
    bench: EngineBench,
    dtype: torch.dtype,
    host_weights: torch.Tensor | None,
) -> tuple[InstanceCore, EngineRunner]:
    """A fresh one-model instance (the talaria policy, the shipped profile's prices) and
    the runner executing it as a server's would: the native decode kernel where it builds,
    this thread's torch threads on whichever thread runs a step."""
    inst = _instance(bench)
    specs = [model.arch.to_spec(name, dtype, source=model.source)]
    core = InstanceCore(inst, specs, POLICIES["talaria"], estimator_for(inst, specs))
    runner = EngineRunner(
        core.layout,
        {name: (model.arch, model.tensors)},
        dtype=dtype,
        host_weights={name: host_weights} if host_weights is not None else None,
        decode_kernel=optional_decode_kernel("cpu"),
        threads=torch.get_num_threads(),
    )
    return core, runner


def measure_model(
    name: str,
    model: LoadedModel,
    bench: EngineBench,
    dtype: torch.dtype,
    host_weights: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Prefill, decode and attention timings of one model (seconds) and the sizes the fit
    needs; with ``bench.grid``, also the step grid's points (``grid``) and a step timed alone
    and beside a second engine (``co_run_s_alone``, ``co_run_s_beside``;
    :mod:`talaria.calibration.grid`). ``model`` may carry no tensors when ``host_weights``
    (its flat host weights, as an ``EngineRunner`` keeps them) is given: they are shared,
    not copied. Runs its own event loop (``anyio.run``): call it from synchronous code, on
    a thread that runs no torch itself (the engine is built on a thread that exits, the
    steps run on a worker: :mod:`talaria.engine.threads`)."""
    core, runner = in_own_thread(lambda: _probe_instance(name, model, bench, dtype, host_weights))
    spec = core.models[name]
    probe = _Probe(LocalInstance(core, runner), runner, name, min(30000, model.arch.vocab_size))
    b = bench
    timings = anyio.run(_timings, probe, b)
    grid: dict[str, Any] = {}
    if b.grid is not None:
        flat = runner.host_weights[name]
        grid["grid"] = points_json(measure_grid(name, model.arch, flat, dtype, b.grid))
        grid |= measure_co_run(model.arch, flat, dtype, b.grid)
    del runner, core, probe
    gc.collect()
    out = {
        "weight_bytes": spec.weight_bytes,
        "flops_per_token": spec.flops_per_token,
        "attention_flops_prefill": spec.attention_flops(
            b.prefill_tokens * (b.prefill_tokens + 1) / 2
        ),
        "prefill_tokens": b.prefill_tokens,
        "prefill_s": timings["prefill_s"],
        "short_ctx": b.short_ctx,
        "decode_step_s_batch1": timings["decode_step_s_batch1"],
        "decode_step_s_batch8": timings["decode_step_s_batch8"],
        "kv_bytes_per_token": spec.kv_bytes_per_token,
        "attention_batch": b.attention_batch,
        "long_ctx": b.long_ctx,
        "decode_step_s_short_ctx": timings["decode_step_s_short_ctx"],
        "decode_step_s_long_ctx": timings["decode_step_s_long_ctx"],
        "chunk_tokens": b.chunk,
        "chunk_s_fresh": timings["chunk_s_fresh"],
        "chunk_s_after_prefix": timings["chunk_s_after_prefix"],
        "attention_flops_chunk_extra": spec.attention_flops(b.chunk * b.long_ctx),
        **{k: v for k, v in timings.items() if k.startswith("stage_")},
    }
    return out | grid


def _short(m: Mapping[str, Any]) -> int:
    """The short context of a measurement (256 in documents written before it was recorded)."""
    return int(m.get("short_ctx", 256))


def fit(
    models: Mapping[str, Mapping[str, Any]],
    specs: Mapping[str, ModelSpec] | None = None,
    small_rows: int = 0,
) -> dict[str, Any]:
    """Fit the engine's step costs to the measurements of each model:

    - from models measured at two context lengths, the KV read rate: extra decode time per
      extra context byte (median over the models where the longer run took longer);
    - with it, the time each decoding sequence adds to a step: batch 8 against batch 1, less
      the extra KV reads, over 7;
    - least squares ``t = intercept + bytes / bandwidth`` over the batch-1 decode steps; the
      step overhead is the intercept less one sequence's time (a batch-1 step pays both);
    - the prefill FLOP rate, the median over models of ``FLOPs / (t - overhead)``;
    - the attention FLOP rate: the extra time of a chunk after a cached prefix, less its
      extra KV reads, per extra attention FLOP;
    - where every model measured a step grid and ``specs`` describes them: the additive
      model's prices (:func:`_fit_grid`; ``small_rows``: the rows the engine multiplies with
      its native small-batch product, :func:`small_rows`), which price a step in place of
      the rates above.
    """
    long = [m for m in models.values() if "decode_step_s_long_ctx" in m]
    out = _fit_kv_reads(long)
    per_seq = out.get("decode_seq_s", 0.0)
    w = np.array([m["weight_bytes"] for m in models.values()], dtype=float)
    t = np.array([m["decode_step_s_batch1"] for m in models.values()], dtype=float)
    a = np.vstack([np.ones_like(w), w]).T
    (intercept, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
    overhead = max(0.0, float(intercept) - per_seq)
    per_byte = float(per_byte) if per_byte > 0 else float(np.mean(t / w))
    rates = []
    for m in models.values():
        flops = m["prefill_tokens"] * m["flops_per_token"] + m["attention_flops_prefill"]
        rates.append(flops / max(1e-9, m["prefill_s"] - overhead))
    out |= {
        "decode_weight_B_s": 1.0 / per_byte,
        "step_overhead_s": overhead,
        "prefill_flop_s": float(statistics.median(rates)),
    }
    out |= _fit_stage(models)
    if "decode_kv_B_s" in out:
        out |= _fit_attention(long, out["decode_kv_B_s"])
    if specs is not None and all("grid" in m for m in models.values()):
        out |= _fit_grid(models, specs, small_rows)
    return out


def small_rows(dtype: torch.dtype) -> int:
    """The rows up to which the engine on this CPU multiplies ``dtype`` weights with its
    native small-batch product (0: it has none for them)."""
    native = dtype == torch.bfloat16 and optional_decode_kernel("cpu") is not None
    return MAX_SMALL_M if native else 0


def _fit_grid(
    models: Mapping[str, Mapping[str, Any]], specs: Mapping[str, ModelSpec], small: int
) -> dict[str, Any]:
    """The additive model's prices fitted to every model's step grid (bare forwards), plus
    what the serving path adds: the batch-1 decode step served (``decode_step_s_batch1``)
    less its grid price is the step overhead the serving loop adds, and batch 8 against
    batch 1 likewise gives what it adds per decoding sequence (medians over the models).
    The fit's error on held-out grid points comes with it (``step_grid_held_out``), and so
    does how many times longer a step takes beside a second engine stepping on another
    thread (``co_run_slowdown``, the median over the models, at least 1)."""
    points = [StepPoint.from_json(d) for m in models.values() for d in m["grid"]]
    bare = fit_steps(points, specs, small)
    extra_step, extra_seq = [], []
    for name, m in models.items():
        spec, ctx = specs[name], _short(m)
        one = bare.step_s(spec, StepShape.decode(1, ctx))
        eight = bare.step_s(spec, StepShape.decode(8, 8 * ctx))
        extra_step.append(m["decode_step_s_batch1"] - one)
        served = m["decode_step_s_batch8"] - m["decode_step_s_batch1"]
        extra_seq.append((served - (eight - one)) / 7)
    prices = bare.plus(statistics.median(extra_step), statistics.median(extra_seq))
    co_run = [m["co_run_s_beside"] / m["co_run_s_alone"] for m in models.values()]
    return {
        "co_run_slowdown": max(1.0, float(statistics.median(co_run))),
        "step_prices": prices.to_json(),
        "step_grid_bare": bare.to_json(),
        "step_grid_in_sample": residuals(bare, points, specs).summary(),
        "step_grid_held_out": cross_validate(points, specs, small).summary(),
    }


def _fit_kv_reads(long: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """From the models measured at two context lengths: the KV read rate
    (``decode_kv_B_s``) and, with it, one decoding sequence's time (``decode_seq_s``);
    each only where some model's measurements give a positive value."""
    out: dict[str, float] = {}
    kv_rates = []
    for m in long:
        extra_kv = m["attention_batch"] * (m["long_ctx"] - _short(m)) * m["kv_bytes_per_token"]
        dt_s = m["decode_step_s_long_ctx"] - m["decode_step_s_short_ctx"]
        if dt_s > 0:
            kv_rates.append(extra_kv / dt_s)
    if not kv_rates:
        return out
    kv_rate = out["decode_kv_B_s"] = float(statistics.median(kv_rates))
    seq_times = [
        x
        for m in long
        if (
            x := (
                m["decode_step_s_batch8"]
                - m["decode_step_s_batch1"]
                - 7 * _short(m) * m["kv_bytes_per_token"] / kv_rate
            )
            / 7
        )
        > 0
    ]
    if seq_times:
        out["decode_seq_s"] = float(statistics.median(seq_times))
    return out


def _fit_attention(long: Sequence[Mapping[str, Any]], kv_rate: float) -> dict[str, float]:
    """The attention FLOP rate: a chunk's extra time after a cached prefix, less its extra
    KV reads at ``kv_rate``, per extra attention FLOP (none if no model's is positive)."""
    attn_rates = []
    for m in long:
        reads = m["long_ctx"] * m["kv_bytes_per_token"] / kv_rate
        dt_s = m["chunk_s_after_prefix"] - m["chunk_s_fresh"] - reads
        if dt_s > 0:
            attn_rates.append(m["attention_flops_chunk_extra"] / dt_s)
    return {"attention_flop_s": float(statistics.median(attn_rates))} if attn_rates else {}


def _fit_stage(models: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """A weight stage's contention with the steps beside it, the median over the models that
    measured it: how many times longer a decode step takes beside the stage copy (at least
    1: a copy cannot speed a step up; the measurement's noise can), and the share of its
    idle rate the copy keeps beside the steps (at most 1)."""
    measured = [m for m in models.values() if "stage_decode_step_s_beside" in m]
    if not measured:
        return {}
    slow = [m["stage_decode_step_s_beside"] / m["stage_decode_step_s_alone"] for m in measured]
    share = [m["stage_B_s_beside_decode"] / m["stage_B_s_idle"] for m in measured]
    return {
        "stage_step_slowdown": max(1.0, float(statistics.median(slow))),
        "stage_share_beside_steps": min(1.0, max(1e-6, float(statistics.median(share)))),
    }


ModelSource = Callable[[], Iterator[tuple[str, LoadedModel, torch.Tensor | None]]]
"""Yields (name, model, flat host weights or None) one model at a time, so a caller that
loads from disk holds one model's tensors at once."""


def measure_engine(
    models: ModelSource,
    bench: EngineBench,
    dtype: torch.dtype,
    measured_by: str,
    on_model: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """:func:`measure_model` on every model ``models`` yields, then :func:`fit`: the
    ``engine`` section of a ``cpu_profile.json`` document. ``on_model`` hears each model's
    name before it is measured."""
    measured: dict[str, dict[str, Any]] = {}
    specs: dict[str, ModelSpec] = {}
    for name, model, host in models():
        if on_model is not None:
            on_model(name)
        measured[name] = measure_model(name, model, bench, dtype, host)
        specs[name] = model.arch.to_spec(name, dtype, source=model.source)
    if len(measured) < 2:
        raise ConfigError("the engine fit needs at least two models of different sizes")
    return {
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "method": f"{measured_by}: EngineRunner plan/execute (worker thread)/commit on each "
        f"model, {dtype}, "
        f"{torch.get_num_threads()} threads; {bench.describe()}",
        "models": measured,
        "fit": fit(measured, specs, small_rows(dtype)),
    }
