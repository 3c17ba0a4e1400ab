"""Talaria on vLLM against plain vLLM and against Talaria's embedded engine, through one
black-box OpenAI client.

The embedded replay's workload (the same 12 real SWE-bench sessions, token counts scaled by
1/8, the same three models: SmolLM2-135M with real weights, Qwen2.5-0.5B and Llama-3.2-1B
with random weights) is played in real time against five deployments, one after another:

* ``vllm``: three plain ``vllm serve`` processes, one per model, sessions routed by model
  (as a user without Talaria would deploy them): vLLM's defaults, prefix caching on,
  ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV each. vLLM's default CPU binding (``auto``) puts
  each server's compute threads on the cores of one NUMA node less one reserved for its
  scheduler: on 2 cores, every server on core 0. Two other bindings a user could choose are
  measured too, so plain vLLM is compared at its best:
* ``vllm-spread``: the same, server *i* bound to core *i* mod the number of cores (servers
  on cores of their own, as far as there are cores);
* ``vllm-all``: the same, every server bound to every core (Talaria's binding);
* ``talaria-vllm``: ``talaria serve --backend vllm`` over the same three model directories
  (one vLLM engine per model, the same KV space each, each engine's threads on every core
  of its NUMA node: Talaria's slot runs one at a time), Talaria's policy deciding;
* ``talaria-embedded``: ``talaria serve`` on the embedded engine with its default config.

The client is the same for all of them: ``POST /v1/completions`` with the call's prompt as
token ids, ``max_tokens`` the trace's answer length with ``ignore_eos`` (answers are not
teacher-forced: no server here can be made to, so each next prompt is the trace's, identical
for every deployment), streamed for the time to first token, the session in ``X-Session-ID``
(both vLLM 0.32 and Talaria read it), the tool gap slept. Talaria's deployments also get the
hints an agent integration sends (``tool_start`` with the tool's typical time, ``end``);
plain vLLM has no such endpoint. Reported per deployment: SCT p50/p95/mean, TTFT p50/p95,
cached prompt tokens (the servers' own ``cached_tokens``), the process tree's peak resident
memory, start-up time. Run it in the vLLM environment (docs/backends/vllm.md)::

    .venv-vllm/bin/python benchmarks/vllm_serving.py --json benchmarks/results/vllm_serving.json

About 50 minutes on this machine, most of it vLLM starting twelve engines (``--only`` picks
deployments).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.serve_process import free_port  # noqa: E402
from talaria.backends.vllm.catalog import VllmModel  # noqa: E402
from talaria.backends.vllm.engines import CPU_BIND_VAR, cpu_bind_all  # noqa: E402
from talaria.backends.vllm.model_dirs import catalog_for  # noqa: E402
from talaria.config import cache_dir  # noqa: E402
from talaria.engine.catalog import DEFAULT_MODELS  # noqa: E402
from talaria.swebench_replay.driver import to_scripts  # noqa: E402
from talaria.swebench_replay.setup import load_workload  # noqa: E402
from talaria.types import SessionScript  # noqa: E402

DEPLOYMENTS = ("vllm", "vllm-spread", "vllm-all", "talaria-vllm", "talaria-embedded")
PLAIN = ("vllm", "vllm-spread", "vllm-all")  # plain vLLM, by its CPU thread binding
KV_GIB = 1  # vLLM's CPU KV space per engine, the same on both vLLM deployments
MAX_MODEL_LEN = 8192  # the embedded replay's context bound (SmolLM2's)
START_TIMEOUT_S = 1800.0


@attrs.frozen
class CallRow:
    session: str
    model: str
    sent_s: float
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int


@attrs.frozen
class SessionRow:
    session: str
    model: str
    sct_s: float
    calls: int


# ------------------------------------------------------------------------------ processes
@attrs.define
class Deployment:
    name: str
    procs: list[subprocess.Popen[bytes]]
    urls: dict[str, str]  # model -> base URL
    hints: bool
    logs: list[Path]
    start_s: float = 0.0


def _tree_rss_bytes(root: int) -> int:
    """Resident memory of ``root`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            status = (entry / "status").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        pid = int(entry.name)
        children.setdefault(ppid, []).append(pid)
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss[pid] = int(line.split()[1]) * 1024
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total


class PeakMemory:
    """Samples the process trees' resident memory every half second; keeps the peak."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, sum(_tree_rss_bytes(p) for p in self.pids))

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _launch(cmd: list[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
        )


def _wait_healthy(d: Deployment) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(d.urls.values())
    while pending:
        for p, log in zip(d.procs, d.logs, strict=True):
            if p.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"{d.name}: a server exited {p.returncode}:\n{tail}")
        for url in list(pending):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    pending.discard(url)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{d.name}: not up in {START_TIMEOUT_S:.0f} s")
        time.sleep(1.0)


def _stop(d: Deployment) -> None:
    for p in d.procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in d.procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _vllm_cmd(m: VllmModel, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(m.path)]
    cmd += ["--served-model-name", m.name, "--dtype", m.dtype, "--port", str(port)]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching"]
    cmd += ["--enable-prompt-tokens-details", "--disable-log-stats"]
    if m.load_format == "dummy":
        cmd += ["--load-format", "dummy"]
    return cmd


def _talaria_cmd(config: Path, port: int) -> list[str]:
    script = Path(sys.executable).with_name("talaria")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "talaria.cli"]
    return [*launcher, "serve", "--config", str(config), "--port", str(port)]


def _vllm_toml(models: Sequence[VllmModel]) -> str:
    lines = ['backend = "vllm"', f"models = {json.dumps([m.name for m in models])}", ""]
    for m in models:
        lines += [f'[vllm_models."{m.name}"]', f"path = {json.dumps(str(m.path))}"]
        lines += [f'load_format = "{m.load_format}"', f'dtype = "{m.dtype}"']
        lines += [f"max_model_len = {MAX_MODEL_LEN}", f"kv_cache_gib = {KV_GIB}", ""]
    return "\n".join(lines)


@contextlib.contextmanager
def deployed(name: str, models: Sequence[VllmModel], work: Path) -> Iterator[Deployment]:
    """Start deployment ``name``, wait until every server answers ``/health``; stop it after."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_GIB), TALARIA_API_KEY="")
    work.mkdir(parents=True, exist_ok=True)
    if name in PLAIN:
        ports = {m.name: free_port() for m in models}
        cores = sorted(os.sched_getaffinity(0))
        binds = {
            "vllm": [None] * len(models),
            "vllm-spread": [str(cores[i % len(cores)]) for i in range(len(models))],
            "vllm-all": [cpu_bind_all()] * len(models),  # Talaria's engines' binding
        }[name]
        cmds = [
            (
                _vllm_cmd(m, ports[m.name]),
                work / f"{name}-{m.name}.log",
                env if bind is None else env | {CPU_BIND_VAR: bind},
            )
            for m, bind in zip(models, binds, strict=True)
        ]
        urls = {m: f"http://127.0.0.1:{p}" for m, p in ports.items()}
        hints = False
    else:
        port = free_port()
        config = work / f"{name}.toml"
        config.write_text(_vllm_toml(models) if name == "talaria-vllm" else "")
        cmds = [(_talaria_cmd(config, port), work / f"{name}.log", env)]
        urls = dict.fromkeys((m.name for m in models), f"http://127.0.0.1:{port}")
        hints = True
    started = time.monotonic()
    d = Deployment(
        name, [_launch(c, log, e) for c, log, e in cmds], urls, hints, [c[1] for c in cmds]
    )
    try:
        _wait_healthy(d)
        d.start_s = time.monotonic() - started
        yield d
    finally:
        _stop(d)


# ------------------------------------------------------------------------------ the client
async def _one_call(
    client: httpx.AsyncClient, url: str, script: SessionScript, index: int
) -> CallRow:
    sc = script.calls[index]
    body = {
        "model": script.model,
        "prompt": list(sc.prompt.tokens()),
        "max_tokens": sc.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    first: float | None = None
    usage: dict[str, Any] = {}
    headers = {"X-Session-ID": str(script.session_id)}
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            if first is None and chunk.get("choices"):
                first = time.monotonic()
            if chunk.get("usage"):
                usage = chunk["usage"]
    done = time.monotonic()
    details = usage.get("prompt_tokens_details") or {}
    return CallRow(
        str(script.session_id),
        script.model,
        sent,
        (first or done) - sent,
        done - sent,
        int(usage.get("prompt_tokens", 0)),
        int(details.get("cached_tokens") or 0),
    )


async def play(
    d: Deployment, scripts: Sequence[SessionScript]
) -> tuple[list[CallRow], list[SessionRow]]:
    calls: list[CallRow] = []
    sessions: list[SessionRow] = []
    limits = httpx.Limits(max_connections=len(scripts) * 2 + 8)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        t0 = time.monotonic()

        async def session(script: SessionScript) -> None:
            await asyncio.sleep(max(0.0, t0 + script.start_s - time.monotonic()))
            url = d.urls[script.model]
            start = time.monotonic()
            events = f"{url}/v1/sessions/{script.session_id}/events"
            for i in range(len(script.calls)):
                calls.append(await _one_call(client, url, script, i))
                run = script.after(i)
                if run is None:
                    break
                if d.hints and run.hint_s is not None:
                    hint = {"event": "tool_start", "expected_s": run.hint_s, "tool": run.tool}
                    await client.post(events, json=hint)
                await asyncio.sleep(run.seconds)
            if d.hints:
                await client.post(events, json={"event": "end"})
            sct = time.monotonic() - start
            sessions.append(
                SessionRow(str(script.session_id), script.model, sct, len(script.calls))
            )

        await asyncio.gather(*(session(s) for s in scripts))
    return calls, sessions


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def summary(
    d: Deployment, calls: Sequence[CallRow], sessions: Sequence[SessionRow], peak: int, wall: float
) -> dict[str, Any]:
    sct = sorted(s.sct_s for s in sessions)
    ttft = sorted(c.ttft_s for c in calls)
    prompt = sum(c.prompt_tokens for c in calls)
    cached = sum(c.cached_tokens for c in calls)
    return {
        "deployment": d.name,
        "sessions": len(sessions),
        "calls": len(calls),
        "sct_p50_s": _pct(sct, 50),
        "sct_p95_s": _pct(sct, 95),
        "sct_mean_s": statistics.fmean(sct) if sct else float("nan"),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p95_s": _pct(ttft, 95),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "peak_rss_gb": peak / 1e9,
        "start_s": d.start_s,
        "replay_wall_s": wall,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--only",
        default=",".join(DEPLOYMENTS),
        help=f"comma-separated subset of {', '.join(DEPLOYMENTS)}",
    )
    ap.add_argument(
        "--sessions", type=int, default=12, help="sessions (default 12, the embedded replay's)"
    )
    ap.add_argument(
        "--calls", type=int, default=96, help="calls in all (default 96, the embedded replay's)"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    ap.add_argument("--work", type=Path, default=Path("runs/vllm-serving"), help="logs and configs")
    args = ap.parse_args(argv)
    chosen = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(chosen) - set(DEPLOYMENTS))
    if unknown:
        ap.error(f"unknown deployments {unknown}; known: {', '.join(DEPLOYMENTS)}")
    workload = load_workload(
        n_sessions=args.sessions,
        target_calls=args.calls,
        models=DEFAULT_MODELS,
        max_context=MAX_MODEL_LEN,
        token_scale=1 / 8,
    )
    scripts = to_scripts(workload.replay, workload.tool_table, 1.0, True)
    models = catalog_for(DEFAULT_MODELS, cache_dir() / "vllm-models")
    n_calls = workload.replay.n_calls
    print(f"workload: {workload.replay.trace}; {len(scripts)} sessions, {n_calls} calls")
    rows = []
    for name in chosen:
        print(f"[{name}] starting")
        with deployed(name, models, args.work) as d:
            print(f"[{name}] up in {d.start_s:.0f} s; replaying in real time")
            pids = [p.pid for p in d.procs]
            with PeakMemory(pids) as mem:
                t = time.monotonic()
                calls, sessions = asyncio.run(play(d, scripts))
                wall = time.monotonic() - t
            rows.append(summary(d, calls, sessions, mem.peak, wall))
            print(json.dumps(rows[-1]))
    report = {
        "benchmark": "vllm_serving",
        "workload": workload.replay.trace,
        "models": list(DEFAULT_MODELS),
        "kv_cache_gib_per_engine": KV_GIB,
        "machine": os.uname().nodename,
        "cores": os.cpu_count(),
    }
    run = {
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "commit": _commit(),
        "command": "python benchmarks/vllm_serving.py " + " ".join(argv or sys.argv[1:]),
        "deployments": rows,
    }
    _table(rows)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = with_run(_read(args.json), report, run)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _read(path: Path) -> dict[str, Any] | None:
    """The report already at ``path`` (None when there is none)."""
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or doc.get("benchmark") != "vllm_serving":
        raise SystemExit(f"{path} is not a vllm_serving report; choose another --json path")
    return doc


def with_run(
    old: Mapping[str, Any] | None, report: Mapping[str, Any], run: Mapping[str, Any]
) -> dict[str, Any]:
    """``report`` with every earlier run of ``old`` (a report of the same workload) and then
    ``run`` under ``runs``: a rerun of a few deployments never drops the others' figures.
    A report of another workload is not mixed in: ``SystemExit`` says so."""
    runs: list[Any] = []
    if old is not None:
        if old.get("workload") != report["workload"]:
            raise SystemExit(
                "the --json file holds runs of another workload "
                f"({old.get('workload')!r}); choose another path"
            )
        runs = list(old.get("runs", ()))
        if "deployments" in old:  # a single run, written before runs were kept
            keep = ("date", "commit", "command", "deployments")
            runs.append({k: old[k] for k in keep if k in old})
    return {**report, "runs": [*runs, dict(run)]}


def _commit() -> str | None:
    """The checkout's commit (None outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def _table(rows: Sequence[Mapping[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="black-box replay, one OpenAI client", title_justify="left")
    cols = (
        "deployment",
        "sct_p50_s",
        "sct_p95_s",
        "ttft_p50_s",
        "ttft_p95_s",
        "cached_share",
        "peak_rss_gb",
        "start_s",
    )
    for c in cols:
        t.add_column(c, justify="left" if c == "deployment" else "right")
    for r in rows:
        t.add_row(*(str(r[c]) if c == "deployment" else f"{r[c]:.2f}" for c in cols))
    Console().print(t)


if __name__ == "__main__":
    sys.exit(main())
