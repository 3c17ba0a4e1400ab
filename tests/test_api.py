"""The in-process API on the real default model (SmolLM2-135M), through SyncTalaria."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from talaria import SyncTalaria, TalariaConfig
from talaria.config import Eviction, Routing, SlotOrder
from talaria.errors import BadRequest, ConfigError, ContextTooLong, UnknownModel, UnknownSession
from talaria.generation import SamplingParams

MODEL = "smollm2-135m"
GB = 10**9


@pytest.fixture(scope="module")
def tal() -> Iterator[SyncTalaria]:
    cfg = TalariaConfig(models=(MODEL,), device_memory_bytes=2 * GB, host_memory_bytes=2 * GB)
    with SyncTalaria(cfg) as t:
        yield t


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_chat_answers_and_a_session_reuses_its_prefix(tal: SyncTalaria) -> None:
    first = tal.chat(
        ask("What is the capital of France?"),
        MODEL,
        session_id="a",
        params=SamplingParams(max_tokens=16, temperature=0),
    )
    assert "Paris" in first.text and first.finish_reason == "stop"
    assert first.usage.completion_tokens == len(first.token_ids) > 0
    history = ask("What is the capital of France?")
    history += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And Italy?"},
    ]
    second = tal.chat(
        history, MODEL, session_id="a", params=SamplingParams(max_tokens=16, temperature=0)
    )
    assert second.usage.cached_tokens >= 16 and second.session_id == "a"
    tal.event("a", "tool_start", tool="bash", expected_s=0.5)
    tal.event("a", "tool_end", measured_s=0.4)
    summary = tal.event("a", "end")
    assert summary is not None and summary.calls == 2 and summary.sct_s > 0
    stats = tal.stats()
    assert stats["events"] == {"tool_start": 1, "tool_end": 1, "end": 1}
    tal.talaria.check_integrity()


def test_stream_matches_the_whole_answer(tal: SyncTalaria) -> None:
    # the same cache state for both: the prompt's full blocks cached by a first call (in bf16
    # a prompt computed whole and one whose tail is computed after a cached prefix may part
    # ways at a near-tie, as with any prefix cache)
    tal.chat(ask("Name a color."), MODEL, params=SamplingParams(max_tokens=1, temperature=0))
    whole = tal.chat(
        ask("Name a color."), MODEL, params=SamplingParams(max_tokens=12, temperature=0)
    )
    chunks = list(
        tal.chat_stream(
            ask("Name a color."), MODEL, params=SamplingParams(max_tokens=12, temperature=0)
        )
    )
    assert "".join(c.text for c in chunks) == whole.text
    last = chunks[-1]
    assert last.finish_reason == whole.finish_reason and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert not tal.talaria.live.sessions  # one-call sessions end with their call


def test_stop_strings_and_seeded_sampling(tal: SyncTalaria) -> None:
    r = tal.complete(
        "1, 2, 3, 4,", MODEL, params=SamplingParams(max_tokens=20, temperature=0, stop=[" 6"])
    )
    assert r.finish_reason == "stop" and " 6" not in r.text and "5" in r.text
    a = tal.chat(
        ask("Tell me a word."), MODEL, params=SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    )
    b = tal.chat(
        ask("Tell me a word."), MODEL, params=SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    )
    assert a.token_ids == b.token_ids


def test_bad_input_is_typed_and_leaves_everything_intact(tal: SyncTalaria) -> None:
    with pytest.raises(UnknownModel, match="smollm2-135m"):
        tal.chat(ask("hi"), "gpt-4", params=SamplingParams(max_tokens=4))
    with pytest.raises(BadRequest, match="messages"):
        tal.chat([], MODEL, params=SamplingParams(max_tokens=4))
    with pytest.raises(BadRequest, match="max_tokens"):
        tal.chat(ask("hi"), MODEL, params=SamplingParams(max_tokens=-1))
    with pytest.raises(BadRequest, match=r"unknown argument\(s\) max_tokens: .*SamplingParams"):
        tal.chat(ask("hi"), MODEL, max_tokens=4)  # type: ignore[call-arg]
    with pytest.raises(BadRequest, match=r"unknown argument\(s\) tools"):
        tal.complete("hi", MODEL, tools=[])  # type: ignore[call-arg]
    with pytest.raises(BadRequest, match="temperature"):
        tal.chat(ask("hi"), MODEL, params=SamplingParams(max_tokens=4, temperature=-2))
    with pytest.raises(ContextTooLong):
        tal.complete("word " * 9000, MODEL, params=SamplingParams(max_tokens=4))
    with pytest.raises(UnknownSession):
        tal.event("never-seen", "tool_start", expected_s=1.0)
    with pytest.raises(BadRequest, match="unknown event"):
        tal.event("never-seen", "lunch")
    with pytest.raises(BadRequest, match="expected_s"):
        tal.event("never-seen", "tool_start", expected_s=float("nan"))
    tal.talaria.check_integrity()
    assert not tal.talaria.live.sessions and not tal.talaria.live.calls
    assert (
        tal.chat(ask("Say hi."), MODEL, params=SamplingParams(max_tokens=4)).usage.completion_tokens
        > 0
    )
    assert [m.name for m in tal.models()] == [MODEL]


def test_config_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        'models = ["smollm2-135m"]\ndevice_memory_bytes = 2000000000\n'
        '[policy]\nname = "round"\nslot_max_s = 4.0\n'
    )
    cfg = TalariaConfig.from_toml(path)
    assert cfg.models == (MODEL,) and cfg.policy_config().slot_max_s == 4.0
    assert cfg.policy_config().name == "round"
    path.write_text('models = ["nope"]\n')
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        TalariaConfig.from_toml(path)
    path.write_text('modles = ["smollm2-135m"]\n')
    with pytest.raises(ConfigError, match="unknown keys"):
        TalariaConfig.from_toml(path)
    with pytest.raises(ConfigError, match="does not exist"):
        TalariaConfig.from_toml(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="unknown policy knobs"):
        TalariaConfig(policy_overrides={"slot_max": 1})


def test_every_tuned_knob_reads_from_toml_enum_knobs_by_their_text(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        '[policy]\nname = "talaria"\nslot_order = "round-robin"\nrouting = "sticky"\n'
        'eviction = "lru"\nslot_starvation_s = 1000.0\nslot_preempt_ratio = 16.0\n'
    )
    policy = TalariaConfig.from_toml(path).policy_config()
    assert (policy.slot_order, policy.routing, policy.eviction) == (
        SlotOrder.ROUND_ROBIN,
        Routing.STICKY,
        Eviction.LRU,
    )
    assert (policy.slot_starvation_s, policy.slot_preempt_ratio) == (1000.0, 16.0)
    assert policy.keep_alive_s == math.inf  # instances never scale to zero unless asked
    path.write_text("[policy]\nkeep_alive_s = 30.0\n")
    assert TalariaConfig.from_toml(path).policy_config().keep_alive_s == 30.0
    path.write_text("[policy]\nkeep_alive_s = -1\n")
    with pytest.raises(ConfigError, match="keep_alive_s must be zero, a positive number or inf"):
        TalariaConfig.from_toml(path)
    path.write_text('[policy]\nslot_order = "fastest"\n')
    with pytest.raises(ConfigError, match="slot_order must be one of 'round-robin'"):
        TalariaConfig.from_toml(path)


def test_weight_regions_reach_every_instance_and_bad_counts_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text("weight_regions = 2\ninstances = 2\n")
    specs = TalariaConfig.from_toml(path).instance_specs()
    assert [s.weight_regions for s in specs] == [2, 2]
    assert [s.weight_regions for s in TalariaConfig().instance_specs()] == [1]
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="weight_regions must be a positive integer"):
            TalariaConfig(weight_regions=bad)
    with pytest.raises(ConfigError, match="weight_regions is the embedded engine's"):
        TalariaConfig(backend="vllm", weight_regions=2)


def test_ray_places_either_backend_and_counts_gpus(tmp_path: Path) -> None:
    vllm = {"m": {"path": str(tmp_path)}}
    cfg = TalariaConfig(models=("m",), backend="vllm", vllm_models=vllm, ray="local", ray_gpus=1)
    assert (cfg.backend, cfg.ray, cfg.ray_gpus) == ("vllm", "local", 1)
    assert TalariaConfig(ray="local").ray_gpus == 0
    for bad in (-1, -0.5, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ConfigError, match="ray_gpus must be a finite number of 0 or more"):
            TalariaConfig(ray="local", ray_gpus=bad)
