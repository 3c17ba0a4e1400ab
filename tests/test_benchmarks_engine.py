"""``benchmarks/engine.py --quick`` runs end to end and writes every figure (slow: ~2 min)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FIGURES = (
    "load_s",
    "prefill_tok_s_1x1024",
    "prefill_tok_s_4x512",
    "decode_tok_s_batch1",
    "decode_tok_s_batch8",
    "decode_tok_s_batch32",
    "ttft_s_prefix_device",
    "ttft_s_prefix_host",
    "ttft_s_prefix_gone",
    "restore_copy_s",
    "restore_copy_gb_s",
    "ttft_ratio_gone_over_host",
    "restore_vs_recompute_prefix_ratio",
    "tf_load_s",
    "tf_prefill_tok_s_1x1024",
    "tf_decode_tok_s_batch1",
    "tf_decode_tok_s_batch8",
    "tf_generate_tok_s_batch1",
    "tf_generate_tok_s_batch8",
    "switch_s_from_disk",
    "switch_gb_s_from_disk",
    "switch_s_from_host",
    "switch_gb_s_from_host",
    "switch_s_from_staging",
    "switch_gb_s_from_staging",
    "stage_copy_s",
    "decode_step_s_alone",
    "decode_step_s_with_staging",
    "peak_rss_bytes",
    "memory_budget_bytes",
    "rss_over_budget_ratio",
)


@pytest.mark.slow
def test_engine_benchmark_quick_writes_positive_figures(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "engine.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/engine.py", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "prefill" in done.stdout
    doc = json.loads(out.read_text())
    cfg = doc.pop("config")
    assert cfg["quick"] is True
    assert cfg["dtype"] == "bfloat16"
    assert cfg["torch_threads"] >= 1
    if cfg["vllm"] == "not installed":
        assert "vLLM not installed: rows skipped" in done.stdout
    assert "rss_within_10pct" in cfg["switch_memory"]
    assert "staging_fastest" in cfg["switch_memory"]
    assert set(FIGURES) <= set(doc), sorted(set(FIGURES) - set(doc))
    if cfg["decode_kernel"].startswith("DecodeKernel("):  # the native kernel built here
        assert {f"decode_tok_s_batch{b}_gather_sdpa" for b in (1, 8, 32)} <= set(doc)
        assert "decode attention: DecodeKernel(" in done.stdout
    for key, value in doc.items():
        assert isinstance(value, (int, float)) and not isinstance(value, bool), key
        assert math.isfinite(value) and value > 0, (key, value)


def test_engine_benchmark_help() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/engine.py", "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout and "--json" in done.stdout
