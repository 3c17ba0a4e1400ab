"""Convert agent trajectories to Talaria traces (schema ``talaria-trace/1``).

So that users can replay their own runs::

    python -m talaria.swebench_replay.convert runs/ other.traj.json --out my_runs.jsonl

Supported inputs (the format is detected from the file's content):

- **mini-swe-agent 1.x** ``*.traj.json`` (``trajectory_format: mini-swe-agent-1``): a
  ``messages`` list; every assistant message carries the provider response in
  ``extra.response`` (litellm format, ``usage.prompt_tokens`` / ``completion_tokens``); the
  command is the fenced ``bash`` block of its ``content``. 1.x has no timestamps, so tool
  times are ``None`` (the replay draws them from the published per-kind distribution).
- **mini-swe-agent 2.x** ``*.traj.json`` (``mini-swe-agent-1.1``): as 1.x, plus
  ``extra.actions`` (the commands) and ``extra.timestamp`` on assistant and observation
  messages. Tool time = last observation timestamp - response timestamp (the definition of
  the published traces); LLM time = response timestamp - latest earlier timestamp.
- **SWE-agent** ``*.traj``: ``trajectory`` steps with ``action``, ``execution_time`` (the
  tool time) and ``query`` (the messages sent), ``info.model_stats`` with run totals
  ``tokens_sent`` / ``tokens_received`` / ``api_calls``. SWE-agent records no per-call
  usage; when a step has none (``extra_info.usage`` or ``usage``), the run totals are
  apportioned over the steps by the character length of each step's query and response,
  and the session's ``agent`` says "token counts estimated".

A call without usage data (and, for SWE-agent, a run without totals to apportion) raises
:class:`~talaria.errors.TraceError` naming the file and the message or step index.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from talaria.errors import TraceError
from talaria.swebench_replay.traces import (
    ToolKind,
    TraceCall,
    TraceSession,
    session_to_json,
)

# --------------------------------------------------------------------------- tool kinds

_HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1[^\n]*\n.*?\n\s*\2\b", re.DOTALL)
_SEGMENT_SPLIT = re.compile(r"&&|\|\||[;|\n]")
_WRAPPERS = frozenset({"sudo", "time", "env", "timeout", "nohup", "xargs", "command", "exec"})
_TEST_RUNNERS = frozenset({"pytest", "py.test", "tox", "nox"})
_PACKAGE_MANAGERS = frozenset({"pip", "pip3", "conda", "mamba", "apt", "apt-get", "uv", "yum"})
_READ_EDIT = frozenset(
    {
        *("cat", "sed", "grep", "egrep", "fgrep", "rg", "ls", "find", "head", "tail", "nl"),
        *("wc", "awk", "echo", "printf", "cd", "pwd", "touch", "mkdir", "cp", "mv", "rm"),
        *("tree", "diff", "sort", "uniq", "cut", "tr", "less", "more", "file", "stat", "tee"),
        *("patch", "true"),
        # SWE-agent's file tools
        *("str_replace_editor", "open", "goto", "scroll_up", "scroll_down", "search_file"),
        *("search_dir", "find_file", "create", "edit", "filemap"),
    }
)
_PYTHON = re.compile(r"^(?:.*/)?python[\d.]*$")
_PRIORITY = (
    ToolKind.TESTS,
    ToolKind.INSTALL,
    ToolKind.PYTHON_SCRIPT,
    ToolKind.SHELL_READ_EDIT,
    ToolKind.OTHER,
)


def _segment_words(segment: str) -> list[str]:
    words = segment.replace("(", " ").replace(")", " ").split()
    while words and (
        words[0] in _WRAPPERS or "=" in words[0] or words[0].startswith("-") or words[0].isdigit()
    ):
        words = words[1:]
    return words


def _segment_kind(words: Sequence[str]) -> ToolKind:
    if not words:
        return ToolKind.OTHER
    head = words[0]
    module = words[2] if len(words) > 2 and _PYTHON.match(head) and words[1] == "-m" else None
    if (
        head in _TEST_RUNNERS
        or module in ("pytest", "unittest", "tox")
        or any("runtests" in w for w in words)
    ):
        return ToolKind.TESTS
    if "install" in words[1:4] and (head in _PACKAGE_MANAGERS or module == "pip"):
        return ToolKind.INSTALL
    setup_py = len(words) > 2 and words[1].endswith("setup.py")
    if _PYTHON.match(head) and setup_py and words[2] in ("install", "develop"):
        return ToolKind.INSTALL
    if _PYTHON.match(head) or head.endswith(".py"):
        return ToolKind.PYTHON_SCRIPT
    if head in _READ_EDIT:
        return ToolKind.SHELL_READ_EDIT
    return ToolKind.OTHER


def classify_command(command: str) -> ToolKind:
    """The tool kind of a shell command (or several, joined by ``&&``, ``;``, ``|``, lines).

    Per segment: ``pytest`` / ``tox`` / ``python -m pytest`` / ``unittest`` / any
    ``runtests`` -> tests; ``pip`` / ``conda`` / ``apt`` ``install`` (and ``setup.py
    install``) -> install; ``python x.py`` / ``python -c`` -> python_script; ``cat`` ``sed``
    ``grep`` ``ls`` ``find`` ``head`` ``echo`` and similar read/edit commands (and SWE-agent's
    file tools) -> shell_read_edit; anything else -> other. A compound command takes the
    first of tests, install, python_script, shell_read_edit, other that any segment has.
    Here-document bodies are ignored.
    """
    text = _HEREDOC.sub(" ", command)
    kinds = {_segment_kind(_segment_words(seg)) for seg in _SEGMENT_SPLIT.split(text)}
    return next(k for k in _PRIORITY if k in kinds or k is ToolKind.OTHER)


# --------------------------------------------------------------------------- usage


def _int_or_none(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def _dig(obj: object, *keys: str) -> object:
    for key in keys:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _mapping(obj: object) -> Mapping[str, Any]:
    return obj if isinstance(obj, Mapping) else {}


def _first_count(*values: object) -> int | None:
    for value in values:
        count = _int_or_none(value)
        if count is not None:
            return count
    return None


def _usage_counts(usage: object) -> tuple[int, int, int | None, int | None] | None:
    """(prompt, output, cached, reasoning) from a litellm/OpenAI usage object, or None.

    Accepts chat-completions names (``prompt_tokens``, ``completion_tokens``,
    ``*_tokens_details``) and responses-API names (``input_tokens``, ``output_tokens``).
    """
    if not isinstance(usage, Mapping):
        return None
    prompt = _int_or_none(usage.get("prompt_tokens", usage.get("input_tokens")))
    output = _int_or_none(usage.get("completion_tokens", usage.get("output_tokens")))
    if prompt is None or prompt < 1 or output is None:
        return None
    cached = _first_count(
        _dig(usage, "prompt_tokens_details", "cached_tokens"),
        _dig(usage, "input_tokens_details", "cached_tokens"),
        usage.get("prompt_cache_hit_tokens"),
    )
    reasoning = _first_count(
        _dig(usage, "completion_tokens_details", "reasoning_tokens"),
        _dig(usage, "output_tokens_details", "reasoning_tokens"),
    )
    if cached is not None:
        cached = min(cached, prompt)
    return prompt, output, cached, reasoning


# --------------------------------------------------------------------------- mini-swe-agent

_FENCED = re.compile(r"```(?:bash|mswea_bash_command)\s*\n(.*?)\n```", re.DOTALL)


def _timestamp(message: Mapping[str, Any]) -> float | None:
    value = _dig(message, "extra", "timestamp")
    if value is None:
        value = message.get("timestamp")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None  # type: ignore[arg-type]


def _ms(seconds: float) -> float | None:
    """A duration rounded to milliseconds (as in the published traces); a negative one
    (timestamps from different clocks) is not a measurement: ``None``."""
    return round(seconds, 3) if seconds >= 0 else None


def _mini_commands(message: Mapping[str, Any]) -> list[str]:
    actions = _dig(message, "extra", "actions")
    if isinstance(actions, list):
        found = [a.get("command") for a in actions if isinstance(a, Mapping)]
        return [c for c in found if isinstance(c, str)]
    content = message.get("content")
    return _FENCED.findall(content) if isinstance(content, str) else []


def _mini_call(
    path: Path, messages: Sequence[Mapping[str, Any]], i: int, prev_ts: float | None
) -> TraceCall:
    """The call of assistant message ``i``; the tool time reads the messages after it."""
    message = messages[i]
    counts = _usage_counts(_dig(message, "extra", "response", "usage"))
    if counts is None:
        raise TraceError(
            f"{path}: messages[{i}]: assistant message has no usage data "
            "(extra.response.usage.prompt_tokens / completion_tokens); it cannot be replayed "
            "by token counts"
        )
    prompt, output, cached, reasoning = counts
    ts = _timestamp(message)
    obs_ts: list[float] = []
    for later in messages[i + 1 :]:
        if later.get("role") == "assistant":
            break
        t = _timestamp(later) if later.get("role") in ("user", "tool") else None
        if t is not None:
            obs_ts.append(t)
    commands = _mini_commands(message)
    tool_s = None
    if ts is not None and obs_ts:
        tool_s = _ms(max(obs_ts) - ts)
    elif not commands and i + 1 < len(messages):
        tool_s = 0.0  # a format error: nothing ran before the next call
    return TraceCall(
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=output,
        reasoning_tokens=reasoning,
        llm_seconds=_ms(ts - prev_ts) if ts is not None and prev_ts is not None else None,
        tool_seconds=tool_s,
        tool_kind=classify_command("\n".join(commands)) if commands else ToolKind.OTHER,
    )


def convert_mini_swe_agent(path: Path, data: Mapping[str, Any]) -> TraceSession:
    """One mini-swe-agent 1.x/2.x trajectory (parsed ``.traj.json``) as a session."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise TraceError(f"{path}: messages: expected a list of message objects")
    info = _mapping(data.get("info"))
    calls: list[TraceCall] = []
    last_ts: float | None = None
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            calls.append(_mini_call(path, messages, i, last_ts))
        ts = _timestamp(message)
        last_ts = ts if ts is not None else last_ts
    if not calls:
        raise TraceError(f"{path}: messages: no assistant messages, nothing to replay")
    version = info.get("mini_version")
    exit_status = info.get("exit_status")
    if exit_status is None and messages and messages[-1].get("role") == "exit":
        exit_status = _dig(messages[-1], "extra", "exit_status")
    model = _dig(info, "config", "model", "model_name")
    return TraceSession(
        session_id=_session_id(path),
        source=str(path),
        agent=f"mini-swe-agent {version}" if isinstance(version, str) else "mini-swe-agent",
        model=model if isinstance(model, str) and model else "unknown",
        exit_status=exit_status if isinstance(exit_status, str) else None,
        calls=tuple(calls),
    )


def _session_id(path: Path) -> str:
    name = path.name
    for suffix in (".traj.json", ".traj", ".json"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


# --------------------------------------------------------------------------- SWE-agent


def _text_chars(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_text_chars(_mapping(part).get("text")) for part in content)
    return 0


def _query_chars(step: Mapping[str, Any]) -> int:
    query = step.get("query")
    if not isinstance(query, list):
        return 0
    return sum(_text_chars(_mapping(m).get("content")) for m in query)


def _apportion(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders; each at least 1)."""
    scale = total / sum(weights)
    raw = [w * scale for w in weights]
    out = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda k: out[k] - raw[k])
    for k in order[: max(0, total - sum(out))]:
        out[k] += 1
    return [max(1, v) for v in out]


def _swe_estimated_usage(
    path: Path, steps: Sequence[Mapping[str, Any]], stats: Mapping[str, Any]
) -> list[tuple[int, int]]:
    """Per-step (prompt, output) tokens estimated from the run totals of ``model_stats``."""
    sent = _int_or_none(stats.get("tokens_sent"))
    received = _int_or_none(stats.get("tokens_received"))
    if not sent or not received:
        raise TraceError(
            f"{path}: trajectory[0]: steps carry no usage (extra_info.usage) and "
            "info.model_stats has no tokens_sent/tokens_received to apportion; "
            "it cannot be replayed by token counts"
        )
    for i, step in enumerate(steps):
        if _query_chars(step) == 0:
            raise TraceError(
                f"{path}: trajectory[{i}]: no usage and no query (the messages sent), so its "
                "share of info.model_stats.tokens_sent cannot be estimated"
            )
    api_calls = _int_or_none(stats.get("api_calls")) or len(steps)
    share = min(1.0, len(steps) / api_calls)  # requeried (discarded) calls also sent tokens
    prompts = _apportion(max(len(steps), round(sent * share)), [_query_chars(s) for s in steps])
    outputs = _apportion(
        max(len(steps), round(received * share)),
        [max(1, len(str(s.get("response") or ""))) for s in steps],
    )
    return list(zip(prompts, outputs, strict=True))


def _seconds_or_none(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _swe_calls(
    path: Path, steps: Sequence[Mapping[str, Any]], stats: Mapping[str, Any]
) -> tuple[list[TraceCall], bool]:
    """The calls of SWE-agent steps, and whether their token counts are estimates."""
    exact = [
        _usage_counts(_mapping(s.get("extra_info")).get("usage") or s.get("usage")) for s in steps
    ]
    counts: list[tuple[int, int, int | None, int | None]] = []
    if all(c is not None for c in exact):
        counts = [c for c in exact if c is not None]
    else:
        counts = [(p, o, None, None) for p, o in _swe_estimated_usage(path, steps, stats)]
    calls = []
    for step, (prompt, output, cached, reasoning) in zip(steps, counts, strict=True):
        action = step.get("action")
        has_action = isinstance(action, str) and bool(action.strip())
        calls.append(
            TraceCall(
                prompt_tokens=prompt,
                output_tokens=output,
                cached_tokens=cached,
                reasoning_tokens=reasoning,
                tool_seconds=_seconds_or_none(step.get("execution_time")),
                tool_kind=classify_command(str(action)) if has_action else ToolKind.OTHER,
            )
        )
    return calls, len(counts) != len([c for c in exact if c is not None])


def _swe_model(data: Mapping[str, Any]) -> str:
    info = _mapping(data.get("info"))
    for key in ("model_name", "model"):
        if isinstance(info.get(key), str) and info[key]:
            return str(info[key])
    replay = data.get("replay_config")
    if isinstance(replay, str):
        try:
            replay = json.loads(replay)
        except json.JSONDecodeError:
            replay = None
    name = _dig(replay, "agent", "model", "name")
    return name if isinstance(name, str) and name else "unknown"


def convert_swe_agent(path: Path, data: Mapping[str, Any]) -> TraceSession:
    """One SWE-agent trajectory (parsed ``.traj``) as a session; see the module docstring."""
    steps = data.get("trajectory")
    if not isinstance(steps, list) or not all(isinstance(s, Mapping) for s in steps):
        raise TraceError(f"{path}: trajectory: expected a list of step objects")
    if not steps:
        raise TraceError(f"{path}: trajectory: no steps, nothing to replay")
    info = _mapping(data.get("info"))
    calls, estimated = _swe_calls(path, steps, _mapping(info.get("model_stats")))
    version = info.get("swe_agent_version")
    agent = f"SWE-agent {version}" if isinstance(version, str) else "SWE-agent"
    if estimated:
        agent += " (token counts estimated from model_stats)"
    exit_status = info.get("exit_status")
    return TraceSession(
        session_id=_session_id(path),
        source=str(path),
        agent=agent,
        model=_swe_model(data),
        exit_status=exit_status if isinstance(exit_status, str) else None,
        calls=tuple(calls),
    )


# --------------------------------------------------------------------------- files


def convert_file(path: Path | str, model: str | None = None) -> TraceSession:
    """Convert one trajectory file, detecting its format; ``model`` overrides its model name."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trajectory: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: not a JSON trajectory ({e})") from None
    if not isinstance(data, Mapping):
        raise TraceError(
            f"{path}: expected a JSON object (a trajectory), got {type(data).__name__}"
        )
    if "trajectory" in data:
        session = convert_swe_agent(path, data)
    elif "messages" in data:
        session = convert_mini_swe_agent(path, data)
    else:
        raise TraceError(
            f"{path}: not a known trajectory: expected 'messages' (mini-swe-agent .traj.json) "
            "or 'trajectory' (SWE-agent .traj)"
        )
    if model:
        session = TraceSession(
            session.session_id,
            session.source,
            session.agent,
            model,
            session.exit_status,
            session.calls,
        )
    return session


def find_trajectories(inputs: Iterable[Path | str]) -> list[Path]:
    """The trajectory files named by ``inputs``: files as given, directories searched
    recursively for ``*.traj.json`` and ``*.traj`` (sorted). Missing inputs raise TraceError."""
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            hits = sorted({*path.rglob("*.traj.json"), *path.rglob("*.traj")})
            if not hits:
                raise TraceError(f"{path}: no *.traj.json or *.traj files in this directory")
            found.extend(hits)
        elif path.is_file():
            found.append(path)
        else:
            raise TraceError(f"{path}: no such file or directory")
    return found


def write_trace(sessions: Iterable[TraceSession], path: Path | str) -> int:
    """Write ``sessions`` as a ``talaria-trace/1`` file (atomically); returns how many.

    Raises :class:`TraceError` when two sessions share an id (the loader would reject the
    file) or when there is nothing to write.
    """
    path = Path(path)
    rows = [session_to_json(s) for s in sessions]
    seen: set[str] = set()
    for row in rows:
        if row["session_id"] in seen:
            raise TraceError(
                f"{path}: session_id {row['session_id']!r} appears twice; a trace file needs "
                "unique ids (write the runs of different models to different files)"
            )
        seen.add(row["session_id"])
    if not rows:
        raise TraceError(f"{path}: no sessions to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(rows)


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m talaria.swebench_replay.convert",
        description=(
            "Convert mini-swe-agent (.traj.json, 1.x and 2.x) and SWE-agent (.traj) "
            "trajectories to a Talaria trace (talaria-trace/1) for replay."
        ),
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="trajectory files, or directories searched for *.traj.json and *.traj",
    )
    parser.add_argument("--out", required=True, type=Path, help="trace file to write (.jsonl)")
    parser.add_argument("--model", help="model name to record instead of the trajectory's")
    parser.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip trajectories that cannot be converted (reported on stderr) instead of failing",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry; returns the exit status (0 ok, 2 bad input)."""
    args = _parser().parse_args(argv)
    try:
        sessions = []
        for path in find_trajectories(args.inputs):
            try:
                sessions.append(convert_file(path, model=args.model))
            except TraceError as e:
                if not args.skip_bad:
                    raise
                print(f"skipped: {e}", file=sys.stderr)
        n = write_trace(sessions, args.out)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    calls = sum(s.n_calls for s in sessions)
    print(f"wrote {n} sessions ({calls} calls) to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
