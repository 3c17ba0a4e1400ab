"""The embedded engine on a GPU (``benchmarks/gpu_check.sh``, part 1b): switches, staging,
decode and long-prefix restore with published 7-8B configurations and random weights.

One :class:`~talaria.engine.runner.EngineRunner` serves Qwen2.5-7B and Llama-3.1-8B
(``gpu_configs.py``; bfloat16, random weights generated on the device, nothing downloaded) in
one weight region, so the two cannot be resident at once. Every figure goes through the
runner's own copy paths (as ``engine_switch.py`` does on CPU):

1. ``switch_s_from_host``: a model's pinned host copy into the region (``runner._switch``);
2. ``stage_s_idle`` / ``switch_s_from_staging``: the next model staged into lent KV blocks
   on the runner's stager (a CUDA side stream), then the switch that copies the staged bytes
   device -> device; the region is compared byte for byte with the host copy afterwards;
3. decode steps of Llama (context ``--decode-ctx``) at batch 1, 8 and 32, and at batch 32
   beside a stage of Qwen (``decode_slowdown_with_staging_ratio``);
4. a ``--prefix-tokens`` prefix of Llama recomputed in 2048-token chunks against demoted
   to the host tier and restored (``KVPool.execute`` over the pool's links), and whether the
   next decode step's logits over the restored blocks equal those over the original ones;
5. calls of both models through the instance core (``LocalInstance.generate``, talaria's policy):
   wall time, switches (staged), weight bytes moved, and ``check_integrity``.

``--tiny`` runs the same code with two tiny configurations on the CPU (the stager is then the
background copy thread): what ``tests/test_benchmarks_gpu_engine.py`` runs, so the script is
known to work before a GPU is lent. Figures go to ``--out`` as JSON and to stdout as a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_configs import LLAMA31_8B, QWEN25_7B
from talaria.config import InstanceSpec
from talaria.core.instance import InstanceCore
from talaria.cost import estimator_for
from talaria.engine.arch import ModelArch
from talaria.engine.batch import BatchInput, SeqInput
from talaria.engine.runner import EngineRunner
from talaria.memory.kv.types import MovePlan
from talaria.memory.weights import CopyStep, SwitchPlan
from talaria.policy.baselines import POLICIES
from talaria.runtime.local import LocalInstance
from talaria.types import Call, Link, TokenSeq

GIB = 1 << 30
TINY_LLAMA = {
    **LLAMA31_8B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}
TINY_QWEN = {
    **QWEN25_7B,
    "hidden_size": 192,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}
BIG = {"llama-3.1-8b": LLAMA31_8B, "qwen2.5-7b": QWEN25_7B}
TINY = {"tiny-llama": TINY_LLAMA, "tiny-qwen": TINY_QWEN}


@attrs.frozen
class Sizes:
    """How much work each measurement does."""

    prefix_tokens: int = 16384
    chunk: int = 2048
    decode_ctx: int = 2048
    batches: tuple[int, ...] = (1, 8, 32)
    decode_steps: int = 20
    e2e_calls: int = 8  # per model
    e2e_prompt: int = 1024
    e2e_new: int = 32
    host_kv_bytes: int = 4 * GIB
    reps: int = 3


TINY_SIZES = Sizes(
    prefix_tokens=512,
    chunk=128,
    decode_ctx=128,
    batches=(1, 4, 8),
    decode_steps=4,
    e2e_calls=2,
    e2e_prompt=96,
    e2e_new=4,
    host_kv_bytes=8 << 20,
    reps=2,
)


class RandomWeights(Mapping[str, torch.Tensor]):
    """An architecture's parameters made on demand on ``device`` (norm weights one, the rest
    normal with std 0.02), seeded per parameter: the runner flattens them one by one into its
    host copy, so no second full copy of a 16 GB model is ever held."""

    def __init__(self, arch: ModelArch, device: torch.device, dtype: torch.dtype, seed: int):
        self._shapes = arch.param_shapes()
        self._index = {name: i for i, name in enumerate(self._shapes)}
        self._device, self._dtype, self._seed = device, dtype, seed

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self._dtype, device=self._device)
        gen = torch.Generator(device=self._device).manual_seed(self._seed + self._index[name])
        out = torch.randn(shape, generator=gen, dtype=self._dtype, device=self._device)
        return out.mul_(0.02)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def llama_blocks(tokens: int, tpb: int) -> int:
    return -(-tokens // tpb)


def build(
    configs: Mapping[str, Mapping[str, Any]], device: torch.device, sz: Sizes
) -> tuple[EngineRunner, InstanceCore]:
    """One instance serving ``configs`` in one weight region, its device KV pool sized to lend
    the larger model whole for staging beside the decode batch and two copies of the prefix."""
    dtype = torch.bfloat16
    archs = {name: ModelArch.from_hf_config(cfg) for name, cfg in configs.items()}
    specs = [arch.to_spec(name, dtype) for name, arch in archs.items()]
    largest = max(s.weight_bytes for s in specs)
    block_bytes = 16 * max(a.kv_bytes_per_token(dtype) for a in archs.values())
    tpb = block_bytes // next(iter(archs.values())).kv_bytes_per_token(dtype)
    per_seq = llama_blocks(sz.decode_ctx + sz.decode_steps + 2, tpb)
    blocks = (
        llama_blocks(largest, block_bytes)
        + per_seq * max(sz.batches)
        + 2 * llama_blocks(sz.prefix_tokens + 1, tpb)
    )
    kv_bytes = int(blocks * 1.1 + 8) * block_bytes
    host_weights = sum(s.weight_bytes for s in specs)
    spec = InstanceSpec(
        name="gpu-engine",
        hardware="h200-tp8" if device.type == "cuda" else "cpu",
        device_memory_bytes=largest + kv_bytes,
        host_memory_bytes=host_weights + sz.host_kv_bytes,
        block_size=16,
        memory_utilization=1.0,
        host_weight_share=0.99,
    )
    core = InstanceCore(spec, specs, POLICIES["talaria"], estimator_for(spec, specs))
    models = {
        name: (arch, RandomWeights(arch, device, dtype, seed=i * 1000))
        for i, (name, arch) in enumerate(archs.items())
    }
    runner = EngineRunner(core.layout, models, dtype=dtype, device=device)
    return runner, core


def sync(device: torch.device) -> None:
    """Wait for everything queued on the device, on every stream (the stager's too)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_current(device: torch.device) -> None:
    """Wait for the runner's (current) stream only: a stage on the side stream runs on."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # type: ignore[no-untyped-call]


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` (device work included) after one warm-up run."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_plan(runner: EngineRunner, model: str) -> SwitchPlan:
    n = runner.host_weights[model].numel()
    return SwitchPlan(model, (CopyStep(model, Link.HOST_TO_DEVICE, n),), region=0)


def region_matches(runner: EngineRunner, model: str) -> bool:
    """The region holds ``model``'s host bytes exactly (compared in 1 GiB pieces)."""
    host = runner.host_weights[model]
    for lo in range(0, host.numel(), GIB):
        hi = min(lo + GIB, host.numel())
        if not torch.equal(runner.region[lo:hi].cpu(), host[lo:hi]):
            return False
    return True


def measure_switches(runner: EngineRunner, core: InstanceCore, sz: Sizes) -> dict[str, Any]:
    dev, out = runner.device, {}
    for model, host in runner.host_weights.items():
        t = timed(lambda m=model: runner._switch(host_plan(runner, m), ()), dev, sz.reps)
        out[f"switch_s_from_host[{model}]"] = t
        out[f"switch_gb_s_from_host[{model}]"] = host.numel() / t / 1e9
    return out


def stage_runs(runner: EngineRunner, model: str, lent: Sequence[int]) -> list[Any]:
    src = runner.host_weights[model]
    n = src.numel()
    return [(rows.flatten()[: hi - lo], src[lo:hi]) for rows, lo, hi in runner._lent_runs(n, lent)]


def measure_staging_and_decode(
    runner: EngineRunner,
    core: InstanceCore,
    sz: Sizes,
    decoder: str,
    staged: str,
    host_switch_s: float,
) -> dict[str, Any]:
    """Decode of ``decoder`` alone and beside a stage of ``staged``; the staged switch
    (``host_switch_s``: ``staged``'s switch from host, for the ratio)."""
    dev, out = runner.device, {}
    stager = runner._stager
    if stager is None:
        raise RuntimeError("the runner has no stager (background_staging is off)")
    nbytes = runner.host_weights[staged].numel()
    bb = core.kv.block_bytes
    core.kv.return_lent()
    lent = core.kv.lend(-(-nbytes // bb))
    core.slots.stage_blocks = lent
    runs = stage_runs(runner, staged, lent)
    try:
        runner._switch(host_plan(runner, decoder), ())
        model, kv = runner.model(decoder, 0), runner.paged[decoder]
        tpb, vocab = kv.tokens_per_block, runner.archs[decoder].vocab_size
        free = iter(b for b in range(core.kv.device_blocks) if b not in set(lent))
        per_seq = llama_blocks(sz.decode_ctx + sz.decode_steps + 2, tpb)
        gen = torch.Generator().manual_seed(7)
        tables = [tuple(next(free) for _ in range(per_seq)) for _ in range(max(sz.batches))]
        for tb in tables:  # prefill each sequence's context once
            ids = torch.randint(0, vocab, (sz.decode_ctx,), generator=gen).tolist()
            model.forward(BatchInput([SeqInput(ids, 0, tb)]), kv)

        def step(batch: int) -> None:
            model.forward(
                BatchInput([SeqInput((1,), sz.decode_ctx, tb) for tb in tables[:batch]]), kv
            )

        for batch in sz.batches:
            t = timed(lambda b=batch: step(b), dev, sz.decode_steps)
            out[f"decode_step_s[batch {batch}]"] = t
            out[f"decode_tokens_s[batch {batch}]"] = batch / t
        big = max(sz.batches)
        alone = out[f"decode_step_s[batch {big}]"]

        # the stage alone (idle device), on the runner's stager
        sync(dev)
        t0 = time.perf_counter()
        stager.start(staged, lent, runs)
        while not stager.done:
            time.sleep(0.0005)
        stager.wait()
        sync(dev)
        out["stage_s_idle"] = time.perf_counter() - t0
        out["stage_gb_s_idle"] = nbytes / out["stage_s_idle"] / 1e9

        # the stage beside decode steps of the open model (each step waited for on the
        # runner's stream alone: a device-wide synchronize would wait for the stage too)
        step(big)
        sync(dev)
        steps, t0 = 0, time.perf_counter()
        stager.start(staged, lent, runs)
        while not stager.done or steps < 2:
            step(big)
            sync_current(dev)
            steps += 1
            if stager.done and "stage_s_beside_decode" not in out:
                out["stage_s_beside_decode"] = time.perf_counter() - t0
        stager.wait()
        sync(dev)
        out["decode_steps_beside_stage"] = steps
        out["decode_step_s_beside_stage"] = (time.perf_counter() - t0) / steps
        out["stage_gb_s_beside_decode"] = nbytes / out["stage_s_beside_decode"] / 1e9
        out["decode_slowdown_with_staging_ratio"] = out["decode_step_s_beside_stage"] / alone

        # the staged switch: device -> device from the lent blocks
        plan = SwitchPlan(staged, (CopyStep(staged, Link.DEVICE_TO_DEVICE, nbytes),), region=0)

        def from_staging() -> None:
            runner._staged = staged
            runner._switch(plan, lent)

        t = timed(from_staging, dev, sz.reps)
        out["switch_s_from_staging"] = t
        out["switch_gb_s_from_staging"] = nbytes / t / 1e9
        out["switch_staged_over_host_ratio"] = t / host_switch_s
        out["staged_region_exact"] = region_matches(runner, staged)
    finally:
        stager.cancel()
        sync(dev)
        core.kv.return_lent()
        core.slots.stage_blocks = ()
        runner._staged = None
    return out


def measure_prefix(
    runner: EngineRunner, core: InstanceCore, sz: Sizes, model_name: str
) -> dict[str, Any]:
    """A long prefix recomputed in chunks against demoted to host and restored by copy."""
    dev, out = runner.device, {}
    runner._switch(host_plan(runner, model_name), ())
    model, kv = runner.model(model_name, 0), runner.paged[model_name]
    tpb, vocab = kv.tokens_per_block, runner.archs[model_name].vocab_size
    n = llama_blocks(sz.prefix_tokens + 1, tpb)
    table_a = tuple(range(n))
    table_b = tuple(range(n, 2 * n))
    host_ids = tuple(range(n))
    if core.kv.host_blocks < n or core.kv.device_blocks < 2 * n:
        raise RuntimeError(f"the pools are too small for a {sz.prefix_tokens}-token prefix")
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (sz.prefix_tokens,), generator=gen).tolist()

    def recompute() -> None:
        for lo in range(0, sz.prefix_tokens, sz.chunk):
            model.forward(BatchInput([SeqInput(ids[lo : lo + sz.chunk], lo, table_a)]), kv)

    out["prefix_tokens"] = sz.prefix_tokens
    out["prefix_recompute_s"] = timed(recompute, dev, sz.reps)
    bb = core.kv.block_bytes
    demote = MovePlan(Link.DEVICE_TO_HOST, tuple(zip(table_a, host_ids, strict=True)), bb)
    restore = MovePlan(Link.HOST_TO_DEVICE, tuple(zip(host_ids, table_b, strict=True)), bb)
    out["prefix_kv_bytes"] = demote.nbytes
    out["prefix_demote_s"] = timed(lambda: runner.pool.execute(demote), dev, sz.reps)
    out["prefix_restore_s"] = timed(lambda: runner.pool.execute(restore), dev, sz.reps)
    out["prefix_restore_gb_s"] = demote.nbytes / out["prefix_restore_s"] / 1e9
    out["prefix_recompute_over_restore_ratio"] = out["prefix_recompute_s"] / out["prefix_restore_s"]
    nxt = (ids[-1],)
    a = model.forward(BatchInput([SeqInput(nxt, sz.prefix_tokens, table_a)]), kv).float()
    b = model.forward(BatchInput([SeqInput(nxt, sz.prefix_tokens, table_b)]), kv).float()
    out["restored_logits_equal"] = bool(torch.equal(a, b))
    out["restored_logits_max_abs_diff"] = float((a - b).abs().max())
    return out


def measure_end_to_end(runner: EngineRunner, core: InstanceCore, sz: Sizes) -> dict[str, Any]:
    """Calls of both models (interleaved) through the core under talaria's policy."""
    gen = torch.Generator().manual_seed(3)
    calls = []
    for i in range(sz.e2e_calls):
        for name, arch in runner.archs.items():
            ids = torch.randint(0, arch.vocab_size, (sz.e2e_prompt,), generator=gen).tolist()
            calls.append(Call(f"{name}-{i}", 0, name, TokenSeq(ids), sz.e2e_new))
    before = attrs.asdict(core.counters)
    sync(runner.device)
    t0 = time.perf_counter()
    outputs = LocalInstance(core, runner).generate(calls)
    sync(runner.device)
    wall = time.perf_counter() - t0
    core.check_integrity()
    after = attrs.asdict(core.counters)
    delta = {
        k: after[k] - before[k] for k in ("model_switches", "staged_switches", "weight_bytes_moved")
    }
    generated = sum(len(v) for v in outputs.values())
    return {
        "e2e_calls": len(calls),
        "e2e_prompt_tokens": sz.e2e_prompt,
        "e2e_generated_tokens": generated,
        "e2e_all_answered_in_full": generated == len(calls) * sz.e2e_new,
        "e2e_wall_s": wall,
        **{f"e2e_{k}": v for k, v in delta.items()},
    }


def run(tiny: bool, sz: Sizes) -> dict[str, Any]:
    device = torch.device("cpu" if tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny for the CPU version")
    configs = TINY if tiny else BIG
    decoder, staged = list(configs)
    t0 = time.perf_counter()
    runner, core = build(configs, device, sz)
    sync(device)
    out: dict[str, Any] = {
        "build_s": time.perf_counter() - t0,
        "weight_bytes": {m: int(w.numel()) for m, w in runner.host_weights.items()},
        "host_weights_pinned": all(w.is_pinned() for w in runner.host_weights.values())
        if device.type == "cuda"
        else None,
        "region_bytes": core.arena.region_bytes,
        "kv_block_bytes": core.kv.block_bytes,
        "kv_device_blocks": core.kv.device_blocks,
        "kv_host_blocks": core.kv.host_blocks,
        "stager": type(runner._stager).__name__,
    }
    ptr = runner.region.data_ptr()
    print(f"built in {out['build_s']:.1f} s", file=sys.stderr)
    out.update(measure_switches(runner, core, sz))
    print("switches done", file=sys.stderr)
    host_s = out[f"switch_s_from_host[{staged}]"]
    out.update(measure_staging_and_decode(runner, core, sz, decoder, staged, host_s))
    print("staging and decode done", file=sys.stderr)
    out.update(measure_prefix(runner, core, sz, decoder))
    print("prefix done", file=sys.stderr)
    out.update(measure_end_to_end(runner, core, sz))
    out["region_address_stable"] = runner.region.data_ptr() == ptr and all(
        runner.model(m, 0).embed.data_ptr() == ptr for m in runner.archs
    )
    if device.type == "cuda":
        out["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def environment(tiny: bool) -> dict[str, Any]:
    env = {"torch": torch.__version__, "python": platform.python_version(), "tiny": tiny}
    if torch.cuda.is_available() and not tiny:
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def table(figures: Mapping[str, Any]) -> str:
    rows = []
    for key, value in figures.items():
        if isinstance(value, float):
            text = f"{value:.4g}"
        elif isinstance(value, dict):
            text = ", ".join(f"{k} {v}" for k, v in value.items())
        else:
            text = str(value)
        rows.append(f"{key:<44} {text}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="The embedded engine on a GPU: switches from pinned host and from "
        "staging, decode beside a side-stream stage, long-prefix restore vs recompute, and "
        "calls through the core, with Qwen2.5-7B and Llama-3.1-8B (random weights).",
    )
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU (the test)")
    ap.add_argument("--prefix-tokens", type=int, help="the long prefix (default 16384)")
    ap.add_argument("--reps", type=int, help="timed repetitions per figure (default 3)")
    args = ap.parse_args(argv)
    sz = TINY_SIZES if args.tiny else Sizes()
    if args.prefix_tokens is not None:
        if args.prefix_tokens < sz.chunk:
            ap.error(f"--prefix-tokens must be at least one chunk ({sz.chunk})")
        sz = attrs.evolve(sz, prefix_tokens=args.prefix_tokens)
    if args.reps is not None:
        if args.reps < 1:
            ap.error("--reps must be at least 1")
        sz = attrs.evolve(sz, reps=args.reps)
    figures = {"environment": environment(args.tiny), "sizes": attrs.asdict(sz)}
    figures.update(run(args.tiny, sz))
    print(table(figures))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
