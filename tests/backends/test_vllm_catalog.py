"""The vLLM backend's catalog and configuration: TOML tables, typed errors, instance sizing,
and the model directories written from the embedded catalog (no vLLM needed)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from talaria.api import TalariaConfig
from talaria.backends.vllm.catalog import FORCING_PROCESSOR, VllmModel, catalog_from_tables
from talaria.backends.vllm.cluster import GIB, instance_specs
from talaria.backends.vllm.engines import (
    CPU_BIND_VAR,
    EngineSet,
    _environment,
    cpu_bind_all,
    stop_output_handlers,
)
from talaria.backends.vllm.model_dirs import TINY, write_model_dir
from talaria.cli import main
from talaria.engine.arch import ModelArch
from talaria.engine.tokenizer import Tokenizer
from talaria.errors import ConfigError


def test_a_table_becomes_engine_args_with_prefix_caching_and_forcing(tmp_path: Path) -> None:
    m = VllmModel.from_table(
        "q",
        {"path": "q7b", "load_format": "dummy", "max_model_len": 4096, "engine_args": {"seed": 3}},
        base=tmp_path,
    )
    args = m.engine_args(sleep_mode=True, block_size=32)
    assert args["model"] == str(tmp_path / "q7b")
    assert (args["load_format"], args["max_model_len"], args["block_size"]) == ("dummy", 4096, 32)
    assert args["enable_prefix_caching"] and args["enable_sleep_mode"]
    assert args["logits_processors"] == [FORCING_PROCESSOR]
    assert args["seed"] == 3 and "kv_offloading_size" not in args
    off = VllmModel(m.name, m.path, kv_offloading_gib=4)
    assert off.engine_args(sleep_mode=False)["kv_offloading_size"] == 4.0


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ({}, "needs path"),
        ({"path": "x", "colour": 1}, "unknown keys ['colour']"),
        ({"path": "x", "load_format": "gguf"}, "load_format"),
        ({"path": "x", "dtype": "int4"}, "dtype"),
        ({"path": "x", "max_model_len": 8}, "max_model_len"),
        ({"path": "x", "max_model_len": True}, "max_model_len"),
        ({"path": "x", "gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"path": "x", "kv_cache_gib": 0.5}, "whole number of GiB"),
        ({"path": "x", "kv_offloading_gib": -1}, "kv_offloading_gib"),
        ({"path": "x", "sleep_level": 3}, "sleep_level"),
        ({"path": "x", "engine_args": 4}, "engine_args must be a table"),
    ],
)
def test_bad_tables_are_typed_errors(table: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        VllmModel.from_table("m", table)


def test_config_backend_and_tables_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="backend must be one of"):
        TalariaConfig(backend="tgi")
    with pytest.raises(ConfigError, match=r"no \[vllm_models.NAME\] table"):
        TalariaConfig(backend="vllm", models=("m",))
    with pytest.raises(ConfigError, match="unknown model"):
        TalariaConfig(models=("m",))  # the embedded catalog has no "m"
    cfg = tmp_path / "v.toml"
    cfg.write_text('backend = "vllm"\n[vllm_models.m]\npath = "dirs/m"\n')
    loaded = TalariaConfig.from_toml(cfg)
    assert loaded.models == ("m",)  # the tables name the models when models is left out
    (model,) = loaded.vllm_catalog()
    assert model.path == tmp_path / "dirs" / "m"
    with pytest.raises(ConfigError, match="does not exist"):
        model.arch()


def test_catalog_names_must_have_tables() -> None:
    with pytest.raises(ConfigError, match=r"\['b'\] have no"):
        catalog_from_tables({"a": {"path": "x"}}, ("a", "b"))


def test_serve_backend_vllm_needs_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--backend", "vllm"]) == 2
    assert "--backend vllm needs a --config" in capsys.readouterr().out


def test_instance_sizing_with_and_without_sleep_mode(tmp_path: Path) -> None:
    tiny = write_model_dir(TINY, tmp_path)
    arch = tiny.arch()
    a = VllmModel("a", tiny.path, kv_cache_gib=2, gpu_memory_utilization=0.4)
    b = VllmModel("b", tiny.path, gpu_memory_utilization=0.5)
    archs = {"a": arch, "b": arch}
    weights = a.spec(arch).weight_bytes
    resident = instance_specs(
        [a, b],
        archs,
        sleep_mode=False,
        hardware="cpu",
        host_memory_bytes=10**9,
        block_size=32,
        memory_utilization=0.9,
        device_total_bytes=None,
    )
    # resident engines: still one instance (they share the cores), one region per model (each
    # stays loaded) + one KV space
    (only,) = resident
    assert (only.name, only.models, only.weight_regions) == ("vllm-0", (), 2)
    assert only.usable_device_bytes == pytest.approx(2 * weights + 2 * GIB, abs=2)
    (asleep,) = instance_specs(
        [a, b],
        archs,
        sleep_mode=True,
        hardware="cpu",
        host_memory_bytes=10**9,
        block_size=32,
        memory_utilization=0.9,
        device_total_bytes=100 * GIB,
    )
    # sleep mode: one instance, the models taking turns in the largest share of the device
    assert asleep.usable_device_bytes == pytest.approx(50 * GIB, abs=2) and asleep.models == ()
    assert asleep.weight_regions == 1  # one model awake at a time
    with pytest.raises(ConfigError, match="device's memory"):
        instance_specs(
            [a],
            archs,
            sleep_mode=True,
            hardware="cpu",
            host_memory_bytes=0,
            block_size=32,
            memory_utilization=0.9,
            device_total_bytes=None,
        )


def test_the_tiny_model_directory_loads_back(tmp_path: Path) -> None:
    tiny = write_model_dir(TINY, tmp_path)
    config = json.loads((tiny.path / "config.json").read_text())
    assert (config["head_dim"], config["num_attention_heads"], config["vocab_size"]) == (
        64,
        1,
        49152,
    )
    assert tiny.load_format == "dummy"
    arch = tiny.arch()
    assert isinstance(arch, ModelArch) and arch.vocab_size == 49152
    tok = Tokenizer.from_hf_dir(tiny.path)
    assert tok.chat_template and tok.eos_token_id == 2
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"
    again = write_model_dir(TINY, tmp_path)  # a complete directory is reused
    assert again == tiny


def test_end_ids_come_from_both_configs(tmp_path: Path) -> None:
    """vLLM stops on generation_config.json's end ids too (Llama 3's <|eot_id|>): so must
    Talaria's stop checker."""
    from talaria.backends.vllm.cluster import _eos_ids

    tiny = write_model_dir(TINY, tmp_path)
    (tiny.path / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    arch = tiny.arch()
    assert _eos_ids(arch, tiny, tiny.tokenizer()) == (2, 7)
    (tiny.path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        _eos_ids(arch, tiny, None)


def test_cpu_engines_are_bound_to_every_core_of_the_first_allowed_node(tmp_path: Path) -> None:
    for name, cores in {"node0": "0-3,8-11", "node1": "4-7,12-15", "node10": "16"}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "cpulist").write_text(cores + "\n")
    (tmp_path / "node2").mkdir()  # no cpulist: skipped
    (tmp_path / "node3x").mkdir()  # not a node
    assert cpu_bind_all({1, 2, 9, 5}, tmp_path) == "1,2,9"
    assert cpu_bind_all({5, 13, 16}, tmp_path) == "5,13"
    assert cpu_bind_all({16}, tmp_path) == "16"
    assert cpu_bind_all({20, 21}, tmp_path) == "20,21"  # in no node listed: every allowed core
    assert cpu_bind_all({3, 0, 1}, tmp_path / "absent") == "0,1,3"


def test_this_machines_engines_get_cores_it_may_use() -> None:
    bound = {int(c) for c in cpu_bind_all().split(",")}
    assert bound and bound <= os.sched_getaffinity(0)


def test_an_engines_environment_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.delenv(CPU_BIND_VAR, raising=False)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", CPU_BIND_VAR: "0,1"}
    with pytest.raises(RuntimeError), _environment(env):
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
        assert os.environ[CPU_BIND_VAR] == "0,1"
        raise RuntimeError("vLLM could not start")
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert CPU_BIND_VAR not in os.environ


@pytest.fixture
def engine_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of its own, as the vLLM engines' loop does."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


class _Engine:
    """What ``stop_output_handlers`` reads of an ``AsyncLLM``: its output task on the loop,
    which reads "engine core outputs" until cancelled, failing once the core is gone (as
    vLLM's does)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.core_alive = True
        self.failed = False
        self.output_handler: asyncio.Task[None] = asyncio.run_coroutine_threadsafe(
            self._start(), loop
        ).result(5)

    async def _start(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._pull())

    async def _pull(self) -> None:
        while True:
            if not self.core_alive:
                self.failed = True  # vLLM: "AsyncLLM output_handler failed" + EngineDeadError
                return
            await asyncio.sleep(0.001)

    def shutdown(self) -> None:
        self.core_alive = False  # vLLM stops the engine core first


def test_output_handlers_stop_before_the_engine_cores(
    engine_loop: asyncio.AbstractEventLoop,
) -> None:
    engines = [_Engine(engine_loop), _Engine(engine_loop), object()]  # the last: no task
    stop_output_handlers(engine_loop, engines)
    running = [e for e in engines if isinstance(e, _Engine)]
    assert all(e.output_handler.done() and e.output_handler.cancelled() for e in running)
    for e in running:
        e.shutdown()
    assert not any(e.failed for e in running)
    stop_output_handlers(engine_loop, engines)  # again, or on finished tasks: nothing to do


def test_closing_the_engine_set_stops_the_handlers_first(
    engine_loop: asyncio.AbstractEventLoop,
) -> None:
    es = EngineSet([VllmModel("m", Path("m"))])
    engines = {"m": _Engine(engine_loop), "n": _Engine(engine_loop)}
    es._loop, es._engines = engine_loop, dict(engines)  # as start() leaves them, without vLLM
    es.close()
    assert all(not e.core_alive and not e.failed for e in engines.values())
    assert all(e.output_handler.cancelled() for e in engines.values())
    es.close()  # idempotent
