"""The model-switch and memory rows of ``benchmarks/engine.py``.

Model switches and memory (``--switch`` / ``--memory``, both on by default; in a child
process so its peak RSS is the instance's alone): one instance from ``build_embedded`` on
hardware ``cpu`` serves SmolLM2 and ``qwen2.5-0.5b-dummy`` (random weights) with one weight
region. Switch rows time qwen into the region from host (the runner's switch path) and from
KV blocks lent for staging (the runner's device -> device path), SmolLM2 from disk (the GGUF
read and dequantized, then copied in; dummy weights have no file), and a SmolLM2 decode step
alone and beside the runner's background stage copy (``BackgroundCopy``). Memory compares
the peak RSS (``getrusage``) after a few calls with baseline RSS + arena + device and host KV
pools + host weight copies.

The parent (:func:`run_switch_memory`) runs ``benchmarks/engine.py --child-switch-memory``
(:data:`ENGINE_CLI`, the command line beside this file), whose ``main`` calls
:func:`switch_memory_child` and prints its figures as the last line of stdout. Sizes and the
timer come from ``engine_common.py``; ``engine_report.py`` prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from benchmarks.engine_common import BLOCK_TOKENS, PROGRESS, QUICK, Sizes, median_seconds
from talaria.engine.batch import BatchInput, SeqInput
from talaria.engine.staging import BackgroundCopy
from talaria.engine.weight_layout import bind_weights
from talaria.types import Link

ENGINE_CLI = Path(__file__).resolve().with_name("engine.py")
SWITCH_MODELS = ("smollm2-135m", "qwen2.5-0.5b-dummy")
SWITCH_NOTE = (
    "CPU: 'host' and 'device' are both RAM, so a switch from host and one from staging are the "
    "same kind of memcpy here (the runner's staged switch even gathers the lent blocks first, "
    "two copies); staging wins where it overlaps: its host copy runs while the current model "
    "decodes (measured below), leaving only the device copy on the switch's critical path."
)


def switch_memory_instance(quick: bool) -> Any:
    """The InstanceSpec of the switch/memory child: one weight region (the larger model),
    a device KV pool that can lend the whole qwen2.5-0.5b-dummy to staging, a host KV tier."""
    from talaria.config import InstanceSpec

    return InstanceSpec(
        name="bench-cpu",
        hardware="cpu",
        device_memory_bytes=int((2.6 if quick else 3.4) * 1e9),
        host_memory_bytes=int((1.6 if quick else 2.5) * 1e9),
        block_size=BLOCK_TOKENS,
        memory_utilization=0.9,
    )


def _proc_status_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process from /proc (kB there), in bytes; 0 if absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_hwm() -> bool:
    """Reset this process's VmHWM (Linux ``clear_refs`` 5); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def switch_memory_child(args: argparse.Namespace) -> dict[str, Any]:
    """Build one embedded instance serving both models; measure memory, then switches."""
    from talaria.backends.embedded import build_embedded, load_catalog_model
    from talaria.memory.weights import CopyStep, SwitchPlan
    from talaria.policy.baselines import POLICIES
    from talaria.types import Call, TokenSeq

    sz = QUICK if args.quick else Sizes(reps=args.reps)
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    gc.collect()
    baseline = _proc_status_bytes("VmRSS") or _maxrss_bytes()
    spec = switch_memory_instance(args.quick)
    t0 = time.perf_counter()
    inst = build_embedded(spec, SWITCH_MODELS, POLICIES["talaria"], dtype)
    build_s = time.perf_counter() - t0
    runner, core = inst.instance.executor, inst.core
    # Touch every page of the KV pools (torch.zeros maps them lazily): the budget below counts
    # them whole, as a server at full occupancy holds them.
    runner.pool.device_pool.fill_(0)
    runner.pool.host_pool.fill_(0)
    gc.collect()
    out: dict[str, float] = {
        "switch_memory_build_s": build_s,
        "rss_after_build_bytes": _proc_status_bytes("VmRSS") or _maxrss_bytes(),
    }
    hw = {
        "instance": attrs.asdict(spec),
        "models": list(SWITCH_MODELS),
        "weight_bytes": {m: int(t.numel()) for m, t in runner.host_weights.items()},
        "kv_block_bytes": core.kv.block_bytes,
        "kv_device_blocks": core.kv.device_blocks,
        "kv_host_blocks": core.kv.host_blocks,
    }
    if args.memory:
        hwm_reset = _reset_hwm()
        n_calls, new = (2, 4) if args.quick else (4, 16)
        calls = []
        for i in range(n_calls):
            for model in SWITCH_MODELS:
                vocab = runner.archs[model].vocab_size
                ids = torch.randint(0, vocab, (64 if args.quick else 256,), generator=gen)
                calls.append(Call(f"{model}-{i}", 0, model, TokenSeq(ids.tolist()), new))
        PROGRESS.log(f"memory: {len(calls)} calls over both models")
        t0 = time.perf_counter()
        inst.instance.generate(calls)
        out["switch_memory_calls_s"] = time.perf_counter() - t0
        core.check_integrity()
        arena = runner.region.numel()
        kv_dev = runner.pool.device_pool.numel()
        kv_host = runner.pool.host_pool.numel()
        host_w = sum(t.numel() for t in runner.host_weights.values())
        budget = baseline + arena + kv_dev + kv_host + host_w
        peak = _maxrss_bytes()
        out.update(
            {
                "rss_baseline_bytes": baseline,
                "arena_bytes": arena,
                "kv_device_pool_bytes": kv_dev,
                "kv_host_pool_bytes": kv_host,
                "host_weight_bytes": host_w,
                "memory_budget_bytes": budget,
                "peak_rss_bytes": peak,
                "rss_over_budget_ratio": peak / budget,
                "rss_now_bytes": _proc_status_bytes("VmRSS"),
            }
        )
        serving_peak = _proc_status_bytes("VmHWM") if hwm_reset else 0
        if serving_peak:
            out["peak_rss_bytes_serving"] = serving_peak
            out["rss_serving_over_budget_ratio"] = serving_peak / budget
        hw["rss_within_10pct"] = bool(abs(peak / budget - 1) <= 0.10)
        hw["peak_rss_note"] = (
            "peak_rss_bytes is getrusage maxrss over the child's life (build included); "
            "peak_rss_bytes_serving is VmHWM reset after the build (calls only)"
        )
    if args.switch:
        out.update(measure_switches(runner, core, sz, dtype, gen, CopyStep, SwitchPlan))
        out.update(measure_disk(runner, core, dtype, load_catalog_model, sz))
        hw["staging_fastest"] = bool(
            out["switch_s_from_staging"] < min(out["switch_s_from_host"], out["switch_s_from_disk"])
        )
        hw["switch_rows"] = {
            "switch_*_from_host / _from_staging / stage_copy_*": "qwen2.5-0.5b-dummy",
            "switch_*_from_disk": "smollm2-135m (dummy weights have no file: GGUF read + "
            "dequantize + copy into the region)",
            "switch_*_from_host_smollm2": "smollm2-135m",
            "decode_step_s_*": "smollm2-135m decode batch 8 (the running model's slot)",
        }
        hw["switch_note"] = SWITCH_NOTE
    return {"switch_memory": hw, **out}


def measure_switches(
    runner: Any,
    core: Any,
    sz: Sizes,
    dtype: torch.dtype,
    gen: torch.Generator,
    copy_step: Any,
    switch_plan: Any,
) -> dict[str, float]:
    """Host and staged switches of qwen into region 0 through the runner's own copy paths,
    and a SmolLM2 decode step alone and beside the runner's background stage copy."""
    small, big = SWITCH_MODELS
    out: dict[str, float] = {}
    reps = max(sz.reps, 3)

    def host_plan(model: str) -> Any:
        n = runner.host_weights[model].numel()
        return switch_plan(model, (copy_step(model, Link.HOST_TO_DEVICE, n),), region=0)

    # SmolLM2 from host (the same path as qwen's, for the disk row's model)
    t = median_seconds(lambda: runner._switch(host_plan(small), ()), reps)
    out["switch_s_from_host_smollm2"] = t
    out["switch_gb_s_from_host_smollm2"] = runner.host_weights[small].numel() / t / 1e9

    # Lend device KV blocks for staging qwen whole (as core._maybe_stage does).
    nbytes = runner.host_weights[big].numel()
    bb = core.kv.block_bytes
    core.kv.return_lent()
    lent = core.kv.lend(-(-nbytes // bb))
    core.slots.stage_blocks = lent
    src = runner.host_weights[big]

    def stage_copy() -> None:
        """The runner's ``_stage`` copies (host weights -> the lent blocks, in order, as
        slice copies over runs of consecutive blocks) for the whole model (the core stages
        ``arena.staged_bytes``, at most what the loan holds)."""
        for rows, lo, hi in runner._lent_runs(nbytes, lent):
            rows.flatten()[: hi - lo].copy_(src[lo:hi])

    try:
        # decode of SmolLM2 (now in region 0) on blocks not lent, alone and beside staging
        free = [b for b in range(core.kv.device_blocks) if b not in set(lent)]
        bsz, ctx = 8, 64 if sz is QUICK else 256
        per = -(-(ctx + 8) // runner.paged[small].tokens_per_block)
        tables = [tuple(free[i * per : (i + 1) * per]) for i in range(bsz)]
        model = runner.model(small, 0)
        kv = runner.paged[small]
        vocab = runner.archs[small].vocab_size
        ctx_ids = [tuple(torch.randint(0, vocab, (ctx,), generator=gen).tolist()) for _ in tables]
        model.forward(
            BatchInput([SeqInput(ids, 0, tb) for ids, tb in zip(ctx_ids, tables, strict=True)]), kv
        )

        def decode_step() -> None:
            model.forward(BatchInput([SeqInput((1,), ctx, tb) for tb in tables]), kv)

        steps = 4 if sz is QUICK else 12
        decode_step()
        t0 = time.perf_counter()
        for _ in range(steps):
            decode_step()
        out["decode_step_s_alone"] = (time.perf_counter() - t0) / steps
        t = median_seconds(stage_copy, reps)
        out["stage_copy_s"] = t
        out["stage_copy_gb_s"] = nbytes / t / 1e9
        # the runner's background stage: BackgroundCopy (low-priority memmove thread),
        # restarted whenever it finishes, while the decode steps run
        copier = BackgroundCopy()
        runs = [
            (rows.flatten()[: hi - lo], src[lo:hi])
            for rows, lo, hi in runner._lent_runs(nbytes, lent)
        ]
        copies: list[float] = []
        copier.start(big, lent, runs)
        c0 = time.perf_counter()
        t0 = time.perf_counter()
        for _ in range(steps):
            decode_step()
            if copier.done:
                copier.wait()
                copies.append(time.perf_counter() - c0)
                copier.start(big, lent, runs)
                c0 = time.perf_counter()
        out["decode_step_s_with_staging"] = (time.perf_counter() - t0) / steps
        moved = copier.copied_bytes + nbytes * len(copies)
        out["stage_gb_s_beside_decode"] = moved / (time.perf_counter() - t0) / 1e9
        copier.cancel()
        c0 = time.perf_counter()
        copier.start(big, lent, runs)
        copier.wait()
        out["stage_background_s_idle"] = time.perf_counter() - c0
        out["decode_slowdown_with_staging_ratio"] = (
            out["decode_step_s_with_staging"] / out["decode_step_s_alone"]
        )

        # qwen from host into region 0 (the runner's switch path)
        t = median_seconds(lambda: runner._switch(host_plan(big), ()), reps)
        out["switch_s_from_host"] = t
        out["switch_gb_s_from_host"] = nbytes / t / 1e9

        # qwen from staging: the lent blocks hold it whole; device -> device into region 0
        stage_copy()
        staged = switch_plan(big, (copy_step(big, Link.DEVICE_TO_DEVICE, nbytes),), region=0)

        def from_staging() -> None:
            runner._staged = big
            runner._switch(staged, lent)

        t = median_seconds(from_staging, reps)
        out["switch_s_from_staging"] = t
        out["switch_gb_s_from_staging"] = nbytes / t / 1e9
        region = runner.region[:nbytes]
        if not torch.equal(region, runner.host_weights[big]):
            raise RuntimeError("the staged switch left different bytes in the region")
        out["switch_staged_over_host_ratio"] = t / out["switch_s_from_host"]
    finally:
        core.kv.return_lent()
        core.slots.stage_blocks = ()
        runner._staged = None
    # leave the region holding the arena's active model
    active = core.arena.active_model
    if active is not None:
        runner._switch(host_plan(active), ())
    return out


def measure_disk(
    runner: Any, core: Any, dtype: torch.dtype, load: Any, sz: Sizes
) -> dict[str, float]:
    """SmolLM2 from disk: read and dequantize the GGUF, then copy into region 0."""
    small = SWITCH_MODELS[0]
    arch = runner.archs[small]
    nbytes = arch.weight_bytes(dtype)

    def from_disk() -> None:
        loaded = load(small, dtype)
        views = bind_weights(arch, runner.region[:nbytes], dtype)
        for name, view in views.items():
            view.copy_(loaded.tensors[name])

    t = median_seconds(from_disk, max(1, min(sz.reps, 3)))
    active = core.arena.active_model
    if active is not None:
        n = runner.host_weights[active].numel()
        runner.region[:n].copy_(runner.host_weights[active])
    return {"switch_s_from_disk": t, "switch_gb_s_from_disk": nbytes / t / 1e9}


def run_switch_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`switch_memory_child` in a fresh process (its peak RSS is the instance's)."""
    cmd = [
        sys.executable,
        str(ENGINE_CLI),
        "--child-switch-memory",
        "--dtype",
        args.dtype,
        "--reps",
        str(args.reps),
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
        "--switch" if args.switch else "--no-switch",
        "--memory" if args.memory else "--no-memory",
    ] + (["--quick"] if args.quick else [])
    PROGRESS.log("switch/memory: child process " + " ".join(cmd[2:]))
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"switch/memory child failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])
