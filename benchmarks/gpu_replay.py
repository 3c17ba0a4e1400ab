"""The real-engine replay on a GPU: ``talaria replay --substrate embedded`` with published
7-14B configurations (random weights) on CUDA.

Real SWE-bench sessions (the first calls of each, all starting at once, tool gaps as
measured, hints as a client sends them) are played in wall-clock time against the live
runtime on the embedded engine (``swebench_replay/live_replay.py``, the same code as the CPU
replay) on one CUDA device serving Qwen2.5-7B, Llama-3.1-8B and Qwen2.5-14B (bfloat16,
random weights made on the device, answers teacher-forced to the trace's, token counts scaled
by ``--token-scale``). The device budget (``--device-gb`` x 0.9) holds one weight region of
the largest model and some KV, so the three cannot all be awake: switches, KV demotion to the
pinned host tier and staging on the side stream are real. Nothing is calibrated: the routers
and the simulator's prediction price with the shipped ``h200-tp8`` profile at one device.

``--tiny`` runs the same replay on the CPU with three tiny models and a shortened workload
(``tests/test_benchmarks_gpu_replay.py``). The trace comes from ``--trace`` (default: the
library's search, as ``talaria replay`` does). Each policy's summary is written to
``--out``/``policies.json`` as soon as it finishes, the whole results document to
``--out``/``results.json`` at the end (every executed step, measured and priced, to
``steps.json``), and the policy table is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_configs import LLAMA31_8B, QWEN25_7B, QWEN25_14B
from benchmarks.gpu_engine import TINY_LLAMA, TINY_QWEN, RandomWeights
from talaria.calibration.cache import CalibrationMode
from talaria.engine.arch import ModelArch
from talaria.engine.loader import LoadedModel
from talaria.policy.baselines import parse_policies
from talaria.sim.simulator import SimResult
from talaria.swebench_replay.live_replay import EmbeddedOptions, ReplayHooks, run_embedded_replay
from talaria.swebench_replay.metrics import policy_summary
from talaria.swebench_replay.report import (
    fidelity_table,
    mechanism_table,
    policy_table,
    step_cost_table,
)
from talaria.swebench_replay.setup import load_workload

GB = 10**9
BIG = {"qwen2.5-7b": QWEN25_7B, "llama-3.1-8b": LLAMA31_8B, "qwen2.5-14b": QWEN25_14B}
TINY = {
    "tiny-qwen": TINY_QWEN,
    "tiny-llama": TINY_LLAMA,
    "tiny-qwen-wide": {**TINY_QWEN, "hidden_size": 288, "intermediate_size": 768},
}


def random_loader(configs: dict[str, dict[str, Any]], device: torch.device) -> Any:
    """A model loader (``EmbeddedOptions.loader``) making each named configuration with
    random weights generated on ``device`` (flattened into host memory by the replay)."""
    seeds = {name: 1000 * i for i, name in enumerate(configs)}

    def load(name: str, dtype: torch.dtype) -> LoadedModel:
        config = configs[name]
        arch = ModelArch.from_hf_config(config)
        return LoadedModel(
            config=dict(config),
            arch=arch,
            tensors=RandomWeights(arch, device, dtype, seeds[name]),  # type: ignore[arg-type]
            tokenizer=None,
            chat_template=None,
            bos_token_id=None,
            eos_token_ids=(),
            source=f"random weights, published {name} configuration",
            load_format="dummy",
        )

    return load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Real SWE-bench sessions replayed in real time on the embedded engine on "
        "a GPU (Qwen2.5-7B, Llama-3.1-8B, Qwen2.5-14B, random weights): talaria against round.",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-replay"), help="output folder")
    ap.add_argument("--trace", type=Path, help="a trace file (.jsonl) or folder")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU (the test)")
    ap.add_argument("--policies", default="talaria,round", help="comma-separated policies")
    ap.add_argument("--sessions", type=int, default=12, help="sessions (default 12)")
    ap.add_argument("--calls", type=int, default=96, help="calls in all (default 96)")
    ap.add_argument(
        "--token-scale", type=float, default=0.25, help="scale token counts (default 0.25)"
    )
    ap.add_argument("--gap-scale", type=float, default=1.0, help="scale tool gaps (default 1)")
    ap.add_argument(
        "--device-gb",
        type=float,
        default=44.0,
        help="device budget in GB, 0.9 of it usable (default 44: the 29.5 GB region of "
        "Qwen2.5-14B and about 10 GB of KV)",
    )
    ap.add_argument("--host-kv-gb", type=float, default=12.0, help="host KV tier (default 12)")
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.calls < args.sessions:
        ap.error("--sessions must be at least 1 and --calls at least --sessions")
    if not 0 < args.token_scale <= 1 or args.gap_scale <= 0:
        ap.error("--token-scale must be in (0, 1] and --gap-scale positive")
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --tiny for the CPU version")
    configs = TINY if args.tiny else BIG
    archs = {name: ModelArch.from_hf_config(cfg) for name, cfg in configs.items()}
    weights = sum(a.weight_bytes(torch.bfloat16) for a in archs.values())
    largest = max(a.weight_bytes(torch.bfloat16) for a in archs.values())
    if args.tiny:
        device_bytes = int((largest + 8 * 2**20) / 0.9)
        host_bytes = weights + 32 * 2**20
    else:
        device_bytes = int(args.device_gb * GB)
        host_bytes = weights + int(args.host_kv_gb * GB)
    workload = load_workload(
        trace=args.trace,
        n_sessions=args.sessions,
        target_calls=args.calls,
        models=tuple(configs),
        max_context=min(a.max_context for a in archs.values()),
        token_scale=args.token_scale,
        vocab_size=min(1024, *(a.vocab_size for a in archs.values())),
    )
    policies = parse_policies(args.policies)
    options = EmbeddedOptions(
        policies,
        models=tuple(configs),
        device_memory_bytes=device_bytes,
        host_memory_bytes=host_bytes,
        gap_scale=args.gap_scale,
        calibration=CalibrationMode.SHIPPED,
        device=device.type,
        hardware="cpu" if args.tiny else "h200-tp8",
        host_weight_share=weights / host_bytes,
        loader=random_loader(configs, device),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    done: dict[str, Any] = {}

    def on_result(name: str, result: SimResult) -> None:
        done[name] = policy_summary(result)
        (args.out / "policies.json").write_text(json.dumps(done, indent=1) + "\n")
        print(f"{name}: done", file=sys.stderr, flush=True)

    results = run_embedded_replay(
        workload.replay,
        options,
        workload.tool_table,
        ReplayHooks(status=lambda msg: print(msg, file=sys.stderr, flush=True), result=on_result),
    )
    results["workload"]["source"] = workload.source
    if device.type == "cuda":
        results["engine"]["gpu"] = torch.cuda.get_device_name(device)
        results["engine"]["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    steps = results.pop("step_log", {})  # every executed schedule, measured and priced
    (args.out / "steps.json").write_text(json.dumps(steps) + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    from rich.console import Console

    console = Console(width=160)
    console.print(policy_table(results))
    console.print(mechanism_table(results))
    console.print(fidelity_table(results))
    console.print(step_cost_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
