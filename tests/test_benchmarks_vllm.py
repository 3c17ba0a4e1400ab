"""vLLM rows of ``benchmarks/engine.py``: skipped with a how-to line without a vLLM interpreter
(fast, default run); measured beside ours with one (``-m vllm``, needs ``TALARIA_VLLM_PYTHON``
pointing at a python that imports vllm, see ``shared/notes/vllm-cpu.md``; several minutes)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks import engine_vllm
from benchmarks.engine_common import QUICK

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "benchmarks" / "engine.py"
ROWS = ROOT / "benchmarks" / "vllm_rows.py"
VLLM_FIGURES = (
    "vllm_load_s",
    "vllm_prefill_tok_s_1x1024",
    "vllm_prefill_tok_s_4x512",
    "vllm_decode_tok_s_batch1",
    "vllm_decode_tok_s_batch8",
    "vllm_decode_tok_s_batch32",
    "vllm_generate_tok_s_batch1",
    "vllm_ttft_4k_cold_s",
    "vllm_ttft_4k_cached_s",
)


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _engine(*args: str, env_python: str | None = None, timeout: float = 300) -> str:
    """stdout of ``benchmarks/engine.py --vllm-only --quick ARGS`` (exit 0 asserted)."""
    env = {k: v for k, v in os.environ.items() if k != "TALARIA_VLLM_PYTHON"}
    if env_python is not None:
        env["TALARIA_VLLM_PYTHON"] = env_python
    done = subprocess.run(
        [sys.executable, str(ENGINE), "--vllm-only", "--quick", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _assert_skip_line(stdout: str, why: str) -> None:
    line = next(x for x in stdout.splitlines() if "vLLM not installed: rows skipped" in x)
    assert why in line, line
    assert "--vllm-python" in line and "TALARIA_VLLM_PYTHON" in line, line
    assert "vllm-cpu.md" in line, line


@pytest.fixture(scope="module")
def engine() -> ModuleType:
    """``benchmarks/engine_vllm.py``: the vLLM rows of ``benchmarks/engine.py``."""
    return engine_vllm


def _skip_line(engine: ModuleType, vllm_python: str | None) -> str:
    """The line ``measure_vllm`` returns for ``--vllm-python`` (or none); it must skip."""
    args = argparse.Namespace(vllm_python=vllm_python, quick=True, dtype="bfloat16")
    result = engine.measure_vllm(args, QUICK)
    assert result.figures == {} and result.info["status"] == "not installed", result
    return str(result.line)


def test_skip_line_printed_when_the_interpreter_is_missing(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-venv" / "bin" / "python")
    _assert_skip_line(_engine("--vllm-python", missing), f"cannot run {missing}")


def test_skip_line_from_env_var(
    engine: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = str(tmp_path / "bin" / "python")
    monkeypatch.setenv("TALARIA_VLLM_PYTHON", missing)
    _assert_skip_line(_skip_line(engine, None), f"cannot run {missing}")


def test_skip_line_when_the_interpreter_cannot_import_vllm(engine: ModuleType) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter imports vllm")
    line = _skip_line(engine, sys.executable)
    _assert_skip_line(line, f"{sys.executable} cannot import vllm")


def test_skip_line_without_flag_or_env(engine: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter imports vllm: the rows would run")
    monkeypatch.delenv("TALARIA_VLLM_PYTHON", raising=False)
    line = _skip_line(engine, None)
    _assert_skip_line(line, "no --vllm-python or TALARIA_VLLM_PYTHON given")


def test_vllm_rows_imports_no_talaria() -> None:
    """vllm_rows.py runs in vLLM's environment, where talaria is not installed."""
    tree = ast.parse(ROWS.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "talaria"], names


def test_engine_command_parses_in_vllm_rows(engine: ModuleType, tmp_path: Path) -> None:
    """The command engine.py builds carries ours' sizes, and vllm_rows.py accepts it."""
    rows = _load(ROWS, "bench_vllm_rows_for_test")
    sz = QUICK
    cmd = engine.vllm_command("python", tmp_path, sz, "bfloat16", 8, tmp_path / "o.json")
    assert cmd[:2] == ["python", str(engine.VLLM_ROWS)]
    args = rows.parse_args(cmd[2:])
    assert args.model_dir == tmp_path and args.json == tmp_path / "o.json"
    assert (args.prefill_one, args.prefill_batch, args.prefill_each) == (
        sz.prefill_one,
        sz.prefill_batch,
        sz.prefill_each,
    )
    assert (args.decode_ctx, args.decode_tokens, args.decode_batches) == (
        sz.decode_ctx,
        8,
        sz.decode_batches,
    )
    assert (args.ttft_prefix, args.ttft_new, args.reps) == (sz.ttft_prefix, sz.ttft_new, sz.reps)
    assert args.cores == "auto" and args.dtype == "bfloat16"


@pytest.mark.vllm
def test_vllm_rows_measured_beside_ours(tmp_path: Path) -> None:
    python = os.environ.get("TALARIA_VLLM_PYTHON")
    if not python:
        pytest.skip("TALARIA_VLLM_PYTHON is not set (a python that imports vllm)")
    out = tmp_path / "vllm.json"
    stdout = _engine("--json", str(out), env_python=python, timeout=1900)
    assert "measured in the same run" in stdout, stdout[-2000:]
    doc = json.loads(out.read_text())
    cfg = doc.pop("config")
    assert cfg["vllm"] == "measured", cfg["vllm_line"]
    info = cfg["vllm_info"]
    assert info["sizes"]["prefill_one"] == cfg["sizes"]["prefill_one"]
    assert all(n and n > 0 for n in info["ttft_cached_tokens"]), info["ttft_cached_tokens"]
    assert set(VLLM_FIGURES) <= set(doc), sorted(set(VLLM_FIGURES) - set(doc))
    for key, value in doc.items():
        assert key.startswith("vllm_"), key  # --vllm-only: no figure of ours
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
