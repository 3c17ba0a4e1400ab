"""``benchmarks/gpu_engine.py --tiny``: the GPU check's embedded-engine script runs end to end
on the CPU with tiny models, so it is known to work before a GPU is lent."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_engine import TINY, RandomWeights
from talaria.engine.arch import ModelArch
from tests.helpers import run_benchmark


def test_random_weights_are_seeded_and_shaped() -> None:
    arch = ModelArch.from_hf_config(TINY["tiny-qwen"])
    cpu = torch.device("cpu")
    a = RandomWeights(arch, cpu, torch.bfloat16, seed=5)
    b = RandomWeights(arch, cpu, torch.bfloat16, seed=5)
    assert list(a) == list(arch.param_shapes()) and len(a) == len(arch.param_shapes())
    name = "model.layers.1.mlp.up_proj.weight"
    assert tuple(a[name].shape) == arch.param_shapes()[name]
    assert a[name].equal(b[name])
    assert not a[name].equal(a["model.layers.0.mlp.up_proj.weight"])
    assert bool((a["model.norm.weight"] == 1).all())
    assert "lm_head.weight" in a and "no.such.weight" not in a


def test_tiny_run_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "gpu_engine.json"
    done = run_benchmark("gpu_engine.py", "--tiny", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["stager"] == "BackgroundCopy"
    assert figures["staged_region_exact"] is True
    assert figures["restored_logits_equal"] is True
    assert figures["restored_logits_max_abs_diff"] == 0.0
    assert figures["region_address_stable"] is True
    assert figures["e2e_calls"] == 4 and figures["e2e_all_answered_in_full"] is True
    assert figures["e2e_generated_tokens"] == 16
    assert figures["e2e_model_switches"] >= 1
    for key in (
        "switch_s_from_host[tiny-llama]",
        "switch_s_from_host[tiny-qwen]",
        "switch_s_from_staging",
        "stage_s_idle",
        "stage_s_beside_decode",
        "decode_step_s[batch 8]",
        "prefix_recompute_s",
        "prefix_restore_s",
    ):
        assert math.isfinite(figures[key]) and figures[key] > 0, key
    assert figures["decode_steps_beside_stage"] >= 2
    assert "switch_s_from_host[tiny-llama]" in done.stdout


@pytest.mark.parametrize("bad", [["--prefix-tokens", "5"], ["--reps", "0"]])
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    done = run_benchmark("gpu_engine.py", "--tiny", *bad, timeout=60)
    assert done.returncode == 2
    assert "must be at least" in done.stderr
