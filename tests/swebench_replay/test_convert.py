"""Converters from mini-swe-agent and SWE-agent trajectories to traces, and the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from talaria.errors import TraceError
from talaria.swebench_replay.convert import (
    classify_command,
    convert_file,
    find_trajectories,
    main,
    write_trace,
)
from talaria.swebench_replay.traces import ToolKind, load_trace

K = ToolKind


def test_mini_swe_agent_v1(data_dir: Path) -> None:
    path = data_dir / "mini_v1.traj.json"
    s = convert_file(path)
    assert s.session_id == "mini_v1"
    assert s.source == str(path)
    assert s.agent == "mini-swe-agent 1.9.1"
    assert s.model == "anthropic/claude-sonnet-4-20250514"
    assert s.exit_status == "Submitted"
    assert [c.prompt_tokens for c in s.calls] == [1520, 1760, 1900, 2150]
    assert [c.output_tokens for c in s.calls] == [85, 40, 120, 60]
    assert [c.cached_tokens for c in s.calls] == [0, 1536, 1792, 2048]
    assert [c.reasoning_tokens for c in s.calls] == [None, None, 0, None]
    assert [c.tool_kind for c in s.calls] == [
        K.SHELL_READ_EDIT,
        K.OTHER,
        K.TESTS,
        K.SHELL_READ_EDIT,
    ]
    # 1.x has no timestamps: unknown, except the format error (nothing ran)
    assert [c.tool_seconds for c in s.calls] == [None, 0.0, None, None]
    assert all(c.llm_seconds is None for c in s.calls)


def test_mini_swe_agent_v2_timestamps(data_dir: Path) -> None:
    s = convert_file(data_dir / "mini_v2.traj.json")
    assert s.agent == "mini-swe-agent 2.2.7"
    assert s.model == "deepseek/deepseek-chat"
    assert s.exit_status == "Submitted"
    assert [c.prompt_tokens for c in s.calls] == [2036, 2647, 2881, 3108]
    assert [c.cached_tokens for c in s.calls] == [320, 2112, 2624, 3072]
    assert [c.tool_seconds for c in s.calls] == [0.315, 2.22, 0.253, None]
    assert [c.llm_seconds for c in s.calls] == [None, 2.435, 4.885, 2.109]
    # the here-document body ("import pytest") does not make the repro script a test run
    assert [c.tool_kind for c in s.calls] == [
        K.SHELL_READ_EDIT,
        K.INSTALL,
        K.PYTHON_SCRIPT,
        K.SHELL_READ_EDIT,
    ]


def test_mini_swe_agent_v2_toolcalls(data_dir: Path) -> None:
    s = convert_file(data_dir / "mini_v2_toolcall.traj.json")
    assert s.exit_status == "LimitsExceeded"
    assert s.model == "openai/gpt-5-mini"
    first, last = s.calls
    assert (first.prompt_tokens, first.cached_tokens, first.reasoning_tokens) == (1200, 1024, 256)
    assert first.tool_kind is K.TESTS
    assert first.tool_seconds == 12.0  # observation with role "tool"
    assert last.llm_seconds == 3.5
    assert last.tool_seconds is None
    assert last.tool_kind is K.OTHER  # git log


def test_model_override(data_dir: Path) -> None:
    assert convert_file(data_dir / "mini_v2.traj.json", model="m").model == "m"


def test_missing_usage_names_file_and_message(data_dir: Path) -> None:
    path = data_dir / "broken_mini_no_usage.traj.json"
    with pytest.raises(TraceError) as info:
        convert_file(path)
    assert str(info.value).startswith(f"{path}: messages[4]: assistant message has no usage data")


def test_swe_agent_estimates_from_model_stats(data_dir: Path) -> None:
    s = convert_file(data_dir / "swe_agent.traj")
    assert s.session_id == "swe_agent"
    assert s.agent == "SWE-agent 1.0.1 (token counts estimated from model_stats)"
    assert s.model == "claude-3-5-sonnet-20241022"
    assert s.exit_status == "submitted"
    prompts = [c.prompt_tokens for c in s.calls]
    assert sum(prompts) == 3000  # tokens_sent, all three api calls kept
    assert prompts == sorted(prompts)  # each query holds the previous one
    assert sum(c.output_tokens for c in s.calls) == 150
    assert [c.tool_seconds for c in s.calls] == [0.31, 4.2, 0.5]
    assert [c.tool_kind for c in s.calls] == [K.SHELL_READ_EDIT, K.TESTS, K.OTHER]
    assert all(c.cached_tokens is None for c in s.calls)


def test_swe_agent_per_step_usage_is_used_when_present(data_dir: Path, tmp_path: Path) -> None:
    data = json.loads((data_dir / "swe_agent.traj").read_text())
    for i, step in enumerate(data["trajectory"]):
        step["extra_info"] = {
            "usage": {"prompt_tokens": 1000 + 100 * i, "completion_tokens": 40 + i}
        }
    path = tmp_path / "exact.traj"
    path.write_text(json.dumps(data))
    s = convert_file(path)
    assert "estimated" not in s.agent
    assert [c.prompt_tokens for c in s.calls] == [1000, 1100, 1200]
    assert [c.output_tokens for c in s.calls] == [40, 41, 42]


def test_swe_agent_without_usage_or_totals(data_dir: Path) -> None:
    path = data_dir / "broken_swe_no_stats.traj"
    with pytest.raises(TraceError) as info:
        convert_file(path)
    assert str(info.value).startswith(f"{path}: trajectory[0]: steps carry no usage")


def test_unknown_and_unreadable_inputs(tmp_path: Path) -> None:
    bad = tmp_path / "x.traj.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match="not a JSON trajectory"):
        convert_file(bad)
    bad.write_text('{"foo": 1}')
    with pytest.raises(TraceError, match="not a known trajectory"):
        convert_file(bad)
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}')
    with pytest.raises(TraceError, match="no assistant messages"):
        convert_file(bad)
    with pytest.raises(TraceError, match="cannot read"):
        convert_file(tmp_path / "absent.traj")


@pytest.mark.parametrize(
    ("command", "kind"),
    [
        ("cd /testbed && python -m pytest tests/test_a.py -q", K.TESTS),
        ("pytest -x", K.TESTS),
        ("timeout 120 pytest tests", K.TESTS),
        ("FOO=1 tox -e py39", K.TESTS),
        ("./tests/runtests.py admin_views", K.TESTS),
        ("python tests/runtests.py --settings=x", K.TESTS),
        ("python3 -m unittest discover", K.TESTS),
        ("pip install -e .", K.INSTALL),
        ("python -m pip install requests==2.0", K.INSTALL),
        ("conda install -y numpy", K.INSTALL),
        ("apt-get install -y gcc", K.INSTALL),
        ("python setup.py develop", K.INSTALL),
        ("python reproduce.py", K.PYTHON_SCRIPT),
        ("python3 -c 'import a; print(a.x)'", K.PYTHON_SCRIPT),
        ("sed -i 's/a/b/' f.py && python test_issue.py", K.PYTHON_SCRIPT),
        ("cat <<'EOF' > t.py\nimport pytest\npytest.main()\nEOF", K.SHELL_READ_EDIT),
        ("cat src/a.py | grep -n parse", K.SHELL_READ_EDIT),
        ("nl -ba src/a.py | sed -n '10,40p'", K.SHELL_READ_EDIT),
        ("find . -name '*.py' | xargs grep -l parse", K.SHELL_READ_EDIT),
        ("echo 'x = 1' > f.py", K.SHELL_READ_EDIT),
        ("ls -la", K.SHELL_READ_EDIT),
        ("head -50 README.md", K.SHELL_READ_EDIT),
        ("str_replace_editor view /testbed/a.py", K.SHELL_READ_EDIT),
        ("git diff", K.OTHER),
        ("submit", K.OTHER),
        ("", K.OTHER),
    ],
)
def test_classify_command(command: str, kind: ToolKind) -> None:
    assert classify_command(command) is kind


def test_write_trace_round_trip(data_dir: Path, tmp_path: Path) -> None:
    sessions = [convert_file(data_dir / n) for n in ("mini_v1.traj.json", "swe_agent.traj")]
    out = tmp_path / "sub" / "t.jsonl"
    assert write_trace(sessions, out) == 2
    assert load_trace(out) == sessions
    with pytest.raises(TraceError, match="appears twice"):
        write_trace([sessions[0], sessions[0]], tmp_path / "dup.jsonl")
    with pytest.raises(TraceError, match="no sessions"):
        write_trace([], tmp_path / "none.jsonl")


def test_find_trajectories(data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "run" / "inst").mkdir(parents=True)
    shutil.copy(data_dir / "mini_v2.traj.json", tmp_path / "run" / "inst" / "a.traj.json")
    shutil.copy(data_dir / "swe_agent.traj", tmp_path / "run" / "b.traj")
    (tmp_path / "run" / "preds.json").write_text("{}")
    found = find_trajectories([tmp_path / "run"])
    assert [p.name for p in found] == ["b.traj", "a.traj.json"]
    with pytest.raises(TraceError, match="no such file"):
        find_trajectories([tmp_path / "absent"])


def test_cli(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.jsonl"
    inputs = [str(data_dir / "mini_v2.traj.json"), str(data_dir / "mini_v1.traj.json")]
    assert main([*inputs, "--out", str(out)]) == 0
    assert "wrote 2 sessions (8 calls)" in capsys.readouterr().err
    assert [s.session_id for s in load_trace(out)] == ["mini_v2", "mini_v1"]
    bad = [str(data_dir / "broken_mini_no_usage.traj.json")]
    assert main([*inputs, *bad, "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "error: " in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
    assert main([*inputs, *bad, "--skip-bad", "--out", str(tmp_path / "y.jsonl")]) == 0
    assert "skipped: " in capsys.readouterr().err
    assert len(load_trace(tmp_path / "y.jsonl")) == 2


def test_cli_help_runs_as_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "talaria.swebench_replay.convert", "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0
    assert "--out" in done.stdout and "INPUT" in done.stdout
