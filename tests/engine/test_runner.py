"""The engine runner: an instance core's schedules executed on real tensors, in float32.

Tiny random transformers models (Llama, Qwen2) are served through ``EngineRunner`` under the
``talaria`` policy; every generated token is compared with a greedy reference computed by
full-sequence transformers forwards. Instances are sized by hand so the KV pool holds exactly
``device_blocks`` blocks of 8 tokens of the widest model; the estimator has round numbers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from talaria.config import InstanceSpec, PolicyConfig
from talaria.core.instance import InstanceCore
from talaria.engine.arch import ModelArch
from talaria.engine.runner import EngineRunner, flatten_weights
from talaria.engine.staging import BackgroundCopy, StreamCopy
from talaria.engine.weight_files import READ_CHUNK_BYTES, WeightFiles, WeightReads
from talaria.errors import BadRequest, ConfigError
from talaria.generation import SamplingParams
from talaria.memory.weights import CopyStep, SwitchPlan
from talaria.policy.baselines import POLICIES
from talaria.runtime.local import LocalInstance
from talaria.schedule import Request, Schedule
from talaria.types import Call, Link, TokenSeq
from tests.helpers import RoundNumberEstimator as RoundEstimator
from tests.helpers import hf_model, llama_config, qwen2_config, sk

transformers = pytest.importorskip("transformers")

F32 = torch.float32
BLOCK = 8  # tokens per block of the widest model
TALARIA = POLICIES["talaria"]


# ----------------------------------------------------------------------------- models


def llama(seed: int) -> Any:
    return hf_model(llama_config(), seed)


def qwen2(seed: int) -> Any:
    return hf_model(qwen2_config(tie_word_embeddings=True), seed)


@torch.no_grad()
def reference(hf: Any, prompt: Sequence[int], n: int, eos: int | None = None) -> list[int]:
    """Greedy tokens from full-sequence transformers forwards (no cache)."""
    ids, out = list(prompt), []
    for _ in range(n):
        token = int(torch.argmax(hf(torch.tensor([ids])).logits[0, -1]))
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out


def prompt_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=gen).tolist()


def make_runner(
    hfs: dict[str, Any],
    device_blocks: int,
    host_blocks: int = 64,
    policy: PolicyConfig = TALARIA,
    eos: dict[str, set[int]] | None = None,
    background_staging: bool = True,
    device: str = "cpu",
    regions: int = 1,
    host_weight_share: float = 0.65,
    weight_files: WeightFiles | None = None,
) -> LocalInstance[EngineRunner]:
    archs = {name: ModelArch.from_hf_config(hf.config.to_dict()) for name, hf in hfs.items()}
    specs = [arch.to_spec(name, F32) for name, arch in archs.items()]
    block_bytes = BLOCK * max(a.kv_bytes_per_token(F32) for a in archs.values())
    weights = [a.weight_bytes(F32) for a in archs.values()]
    spec = InstanceSpec(
        name="i0",
        hardware="cpu",
        device_memory_bytes=regions * max(weights) + device_blocks * block_bytes,
        host_memory_bytes=2 * sum(weights) + host_blocks * block_bytes,
        block_size=BLOCK,
        memory_utilization=1.0,
        weight_regions=regions,
        host_weight_share=host_weight_share,
    )
    core = InstanceCore(spec, specs, policy, RoundEstimator())
    assert core.kv.device_blocks == device_blocks and core.kv.block_bytes == block_bytes
    models = {name: (archs[name], hf.state_dict()) for name, hf in hfs.items()}
    runner = EngineRunner(
        core.layout,
        models,
        dtype=F32,
        eos_token_ids=eos,
        background_staging=background_staging,
        device=device,
        weight_files=weight_files,
    )
    return LocalInstance(core, runner, eos)


def run_until_idle(runner: LocalInstance[EngineRunner], now: float, ptr: int) -> float:
    """Step (0.05 s a step) until the runner is idle, the weight region never moving from
    ``ptr`` (an idle slot may linger a while for its sessions' returns); returns the clock.
    A stage copying on its own thread takes real time, not steps: while one is under way
    the loop lets the thread run (a busy machine could otherwise spend every step first)."""
    for _ in range(2000):
        if runner.idle:
            return now
        runner.step(now)
        assert runner.executor.region.data_ptr() == ptr
        now += 0.05
        stager = runner.executor._stager
        if stager is not None and stager.active and not stager.done:
            time.sleep(0.001)
    raise AssertionError("the runner never went idle")


def call(session: str, index: int, model: str, prompt: Sequence[int], out: int) -> Call:
    return Call(session, index, model, TokenSeq(prompt), out)


def finished(runner: LocalInstance[EngineRunner], session: str, index: int) -> Request:
    return next(r for r in runner.core.finished if r.key == (sk(session), index))


def assert_clean(runner: LocalInstance[EngineRunner]) -> None:
    """Integrity holds, nothing runs, and once sessions end no KV block is held."""
    core = runner.core
    core.check_integrity()
    assert runner.idle and not core.running
    for session in list(core.kv.sessions):
        core.end_session(session)
    core.check_integrity()
    kv = core.kv
    assert kv.device_available + kv.lent_blocks == kv.device_blocks


# ----------------------------------------------------------------------------- tests


def test_concurrent_sessions_match_greedy_reference() -> None:
    hf = llama(1)
    policy = attrs.evolve(TALARIA, max_batch_tokens=24)  # chunked prefills mix with decodes
    runner = make_runner({"A": hf}, device_blocks=64, policy=policy)
    prompts = {f"s{i}": prompt_ids(n, seed=10 + i) for i, n in enumerate((13, 21, 30))}
    calls = [call(s, 0, "A", p, 12) for s, p in prompts.items()]
    outputs = runner.generate(calls)
    for s, p in prompts.items():
        assert list(outputs[(sk(s), 0)]) == reference(hf, p, 12), s
        req = finished(runner, s, 0)
        assert req.generated == 12 and req.history is not None
        assert req.history.tokens() == (*p, *outputs[(sk(s), 0)][:-1])
    assert_clean(runner)


def test_continuation_reuses_the_prefix_and_matches() -> None:
    hf = llama(2)
    runner = make_runner({"A": hf}, device_blocks=64)
    first = prompt_ids(20, seed=3)
    out0 = runner.generate([call("s", 0, "A", first, 10)])[(sk("s"), 0)]
    assert list(out0) == reference(hf, first, 10)
    second = [*first, *out0, *prompt_ids(5, seed=4)]
    out1 = runner.generate([call("s", 1, "A", second, 10)], now=5.0)[(sk("s"), 1)]
    assert list(out1) == reference(hf, second, 10)
    again = finished(runner, "s", 1)
    # 29 tokens of history have KV: 3 full blocks are reused
    assert again.reused_tokens == 24 and again.restored_tokens == 0
    assert_clean(runner)


def test_end_of_sequence_stops_a_call_early() -> None:
    hf = llama(3)
    prompt = prompt_ids(17, seed=5)
    ref = reference(hf, prompt, 12)
    eos = ref[4]
    expected = ref[: ref.index(eos) + 1]
    runner = make_runner({"A": hf}, device_blocks=32, eos={"A": {eos}})
    other = prompt_ids(9, seed=6)
    outputs = runner.generate([call("s", 0, "A", prompt, 12), call("t", 0, "A", other, 6)])
    assert list(outputs[(sk("s"), 0)]) == expected
    assert list(outputs[(sk("t"), 0)]) == reference(hf, other, 6, eos=eos)
    req = finished(runner, "s", 0)
    assert req.stopped and req.generated == len(expected)
    assert_clean(runner)


def test_eviction_to_host_and_restore_keep_outputs_exact() -> None:
    hf = llama(4)
    runner = make_runner({"A": hf}, device_blocks=10, host_blocks=32)  # 80 tokens of KV
    p1 = prompt_ids(30, seed=7)
    out1 = runner.generate([call("s1", 0, "A", p1, 10)])[(sk("s1"), 0)]  # 5 blocks
    p2 = prompt_ids(50, seed=8)
    out2 = runner.generate([call("s2", 0, "A", p2, 10)], now=2.0)[(sk("s2"), 0)]  # 8 blocks
    assert runner.core.counters.reclaims >= 1 and runner.core.kv.counters.demoted_blocks > 0
    p3 = [*p1, *out1, *prompt_ids(4, seed=9)]  # 44 tokens + 8: 7 blocks
    out3 = runner.generate([call("s1", 1, "A", p3, 8)], now=4.0)[(sk("s1"), 1)]
    assert list(out1) == reference(hf, p1, 10)
    assert list(out2) == reference(hf, p2, 10)
    assert list(out3) == reference(hf, p3, 8)
    again = finished(runner, "s1", 1)
    assert again.restored_tokens > 0
    assert runner.core.kv.counters.restored_blocks > 0
    assert_clean(runner)


@pytest.mark.parametrize(
    ("device_blocks", "staged_links"),
    [
        (160, (Link.DEVICE_TO_DEVICE,)),  # the whole model staged in lent KV blocks
        (40, (Link.DEVICE_TO_DEVICE, Link.HOST_TO_DEVICE)),  # a part staged, the rest from host
    ],
)
@pytest.mark.parametrize("background", [True, False])
def test_two_models_share_one_region(
    device_blocks: int, staged_links: tuple[Link, ...], background: bool
) -> None:
    """Slots alternate A, B, A; B's switch reads what staging (inline, or on the background
    copy thread while A's steps ran) put in lent KV blocks; every answer is transformers'."""
    hfs = {"A": llama(5), "B": qwen2(6)}
    runner = make_runner(hfs, device_blocks=device_blocks, background_staging=background)
    assert isinstance(runner.executor._stager, BackgroundCopy) == background
    switches = alternate_with_staging(runner, hfs)
    assert tuple(step.link for step in switches[1].steps) == staged_links


def alternate_with_staging(
    runner: LocalInstance[EngineRunner], hfs: dict[str, Any]
) -> list[SwitchPlan]:
    """Two rounds of two calls per model, slots alternating A, B, A (B staged while A runs);
    checks every answer against transformers, the region's fixed address and a clean end,
    and returns the switches."""
    ptr = runner.executor.region.data_ptr()
    switches: list[SwitchPlan] = []
    schedule = runner.core.schedule

    def recording(now: float) -> Schedule:
        sched = schedule(now)
        if sched.switch is not None:
            switches.append(sched.switch)
        return sched

    runner.core.schedule = recording  # type: ignore[method-assign]
    prompts = {
        (m, i): prompt_ids(11 + 7 * i, seed=20 + 2 * i + (m == "B")) for m in "AB" for i in range(2)
    }
    now = 0.0
    expected: dict[tuple[str, int], list[int]] = {}
    for rnd in range(2):  # both models have calls queued: the slots alternate A, B, A, B
        for model in "AB":
            for i in range(2):
                session = f"{model}{i}-{rnd}"
                runner.submit(call(session, 0, model, prompts[(model, i)], 8), now)
                expected[(sk(session), 0)] = reference(hfs[model], prompts[(model, i)], 8)
        now = run_until_idle(runner, now, ptr) + 1.0
    for key, want in expected.items():
        assert list(runner.take_output(key)) == want, key
    counters = runner.core.counters
    assert counters.model_switches >= 3
    assert counters.staged_switches >= 1
    assert [s.model for s in switches] == ["A", "B", "A"]
    for name in hfs:  # every model's parameters are views of the one region
        bound = runner.executor.model(name, 0)
        assert bound.embed.untyped_storage().data_ptr() == ptr
    assert_clean(runner)
    return switches


def test_with_a_region_each_two_models_stay_resident_and_switch_without_copies() -> None:
    """Two weight regions: A and B are each brought into their own region once (B through
    staging, as with one region); the slots then alternate A, B, A, B without moving a byte,
    each model's views stay at its region's offset, and every answer is transformers'."""
    hfs = {"A": llama(7), "B": qwen2(8)}
    runner = make_runner(hfs, device_blocks=64, regions=2)
    core = runner.core
    ptr = runner.executor.region.data_ptr()
    now = 0.0
    expected: dict[tuple[str, int], list[int]] = {}
    for rnd in range(3):
        for model in "AB":
            prompt = prompt_ids(9 + 4 * rnd, seed=40 + 2 * rnd + (model == "B"))
            runner.submit(call(f"{model}-{rnd}", 0, model, prompt, 6), now)
            expected[(sk(f"{model}-{rnd}"), 0)] = reference(hfs[model], prompt, 6)
        now = run_until_idle(runner, now, ptr) + 1.0
        if rnd == 0:  # both models are in their regions: nothing moves from here on
            assert {core.arena.residency(m).value for m in hfs} == {"active", "resident"}
            loaded, switches = core.counters.weight_bytes_moved, core.counters.model_switches
    for key, want in expected.items():
        assert list(runner.take_output(key)) == want, key
    assert core.counters.model_switches >= switches + 2
    assert core.counters.weight_bytes_moved == loaded
    offsets = {name: core.arena.region_offset(core.arena.region_of(name) or 0) for name in hfs}
    assert sorted(offsets.values()) == [0, core.arena.region_bytes]
    for name in hfs:
        region = core.arena.region_of(name)
        assert region is not None
        bound = runner.executor.model(name, region)
        assert bound.embed.untyped_storage().data_ptr() == ptr
        assert bound.embed.data_ptr() == ptr + offsets[name]
    assert_clean(runner)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runner_matches_transformers_with_stable_addresses() -> None:
    """On CUDA: two models take turns in one weight region whose device address never
    changes, their host copies are pinned, and every greedy answer is transformers'
    (computed on the CPU)."""
    hfs = {"A": llama(5), "B": qwen2(6)}
    runner = make_runner(hfs, device_blocks=48, device="cuda")
    assert runner.executor.region.is_cuda
    assert all(w.is_pinned() for w in runner.executor.host_weights.values())
    ptr = runner.executor.region.data_ptr()
    now, expected = 0.0, {}
    for rnd in range(2):  # A, B, A, B: each round switches both models in
        for model in "AB":
            p = prompt_ids(17 + rnd, seed=40 + rnd + (model == "B"))
            runner.submit(call(f"{model}-{rnd}", 0, model, p, 8), now)
            expected[(sk(f"{model}-{rnd}"), 0)] = reference(hfs[model], p, 8)
        now = run_until_idle(runner, now, ptr) + 1.0
    for key, want in expected.items():
        assert list(runner.take_output(key)) == want, key
    assert runner.core.counters.model_switches >= 3
    for name in hfs:
        assert runner.executor.model(name, 0).embed.untyped_storage().data_ptr() == ptr
    assert_clean(runner)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stages_the_next_model_on_a_side_stream() -> None:
    """On CUDA the stage is queued on the stager's own stream while A's steps run on the
    runner's; B's switch copies the staged bytes device -> device after the stage's event,
    and every answer is transformers'."""
    hfs = {"A": llama(5), "B": qwen2(6)}
    runner = make_runner(hfs, device_blocks=160, device="cuda")
    stager = runner.executor._stager
    assert isinstance(stager, StreamCopy)
    assert stager.stream != torch.cuda.current_stream(runner.executor.device)
    switches = alternate_with_staging(runner, hfs)
    assert tuple(step.link for step in switches[1].steps) == (Link.DEVICE_TO_DEVICE,)
    assert not stager.active


def test_bad_token_id_is_refused_before_queueing() -> None:
    runner = make_runner({"A": llama(7)}, device_blocks=16)
    with pytest.raises(BadRequest, match="vocabulary"):
        runner.submit(call("s", 0, "A", [1, 2, 500], 4), 0.0)
    assert runner.idle and not runner.records


def test_calls_with_a_whole_cached_prompt_share_a_batch() -> None:
    """Three calls whose prompt a finished call left cached whole, to a block boundary (an
    ``n`` = 3 request after a first answer): each recomputes the last block in a block of its
    own, so they run in one batch (they used to write the same KV slot and fail the step),
    and every answer is transformers'."""
    hfs = {"A": llama(5)}
    runner = make_runner(hfs, device_blocks=48)
    tpb = runner.executor.paged["A"].tokens_per_block
    p = prompt_ids(2 * tpb, seed=61)
    want = reference(hfs["A"], p, 4)
    assert runner.generate([call("s0", 0, "A", p, 4)]) == {(sk("s0"), 0): tuple(want)}
    got = runner.generate([call(f"s{i}", 0, "A", p, 4) for i in (1, 2, 3)], now=10.0)
    assert got == {(sk(f"s{i}"), 0): tuple(want) for i in (1, 2, 3)}
    for i in (1, 2, 3):
        assert finished(runner, f"s{i}", 0).reused_tokens == tpb
    assert_clean(runner)


def test_a_finished_call_leaves_no_sampling_state_after_the_next_work() -> None:
    """A seeded call's generator lives in the runner while it runs; once its driver takes
    its output, the next work names it as dropped and the runner lets it go."""
    runner = make_runner({"A": llama(7)}, device_blocks=16)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    runner.submit(call("s", 0, "A", prompt_ids(9, seed=1), 4), 0.0, params=params)
    now = run_until_idle(runner, 0.0, runner.executor.region.data_ptr())
    assert set(runner.executor._sampling) == {(sk("s"), 0)}
    assert len(runner.take_output((sk("s"), 0))) == 4
    runner.step(now)  # nothing to run: the work only carries the drop
    assert not runner.executor._sampling and not runner.records


def test_a_restart_keeps_the_buffers_only_for_the_same_layout() -> None:
    runner = make_runner({"A": llama(7)}, device_blocks=16)
    layout = runner.core.layout
    with pytest.raises(ConfigError, match="layout"):
        runner.executor.restart(attrs.evolve(layout, device_blocks=layout.device_blocks + 1))
    runner.executor.restart(layout)
    want = reference(llama(7), prompt_ids(9, seed=2), 3)
    assert runner.generate([call("s", 0, "A", prompt_ids(9, seed=2), 3)]) == {
        (sk("s"), 0): tuple(want)
    }


# ----------------------------------------------------------------------------- disk tier


def on_disk(hfs: dict[str, Any], folder: Path) -> WeightFiles:
    """Each model's flat float32 weights written as its weight file."""
    files = WeightFiles(folder)
    for name, hf in hfs.items():
        arch = ModelArch.from_hf_config(hf.config.to_dict())
        files.write(name, flatten_weights(name, arch, hf.state_dict(), F32))
    return files


@pytest.mark.parametrize(
    ("staging", "background", "reads_after", "read"),
    [
        # A starts on host; B and C are read from disk; A was dropped for C and is read again
        (False, False, [0, 1, 2, 3], "BCA"),
        # and with staging the same: staging A (its session may return) while B, then C,
        # runs would read A from disk and drop the running model's host copy, so no stage
        # reads from disk (see test_a_stage_reads_its_file_on_the_reader for one that does)
        (True, False, [0, 1, 2, 3], "BCA"),
        (True, True, [0, 1, 2, 3], "BCA"),
    ],
)
def test_cold_models_load_from_their_files_and_host_copies_follow_the_arena(
    tmp_path: Path, staging: bool, background: bool, reads_after: list[int], read: str
) -> None:
    """A host weight budget of one model and three models: only the first starts on host;
    slots A, B, C, A read each model's file where the arena plans a DISK_TO_HOST step (a
    switch or a stage) and drop the host copies the arena evicts, every answer
    transformers' own."""
    hfs = {"A": llama(11), "B": qwen2(12), "C": llama(13)}
    files = on_disk(hfs, tmp_path)
    policy = attrs.evolve(TALARIA, weight_staging=staging)
    runner = make_runner(
        hfs, device_blocks=40, host_weight_share=0.01, weight_files=files,
        background_staging=background, policy=policy,
    )  # fmt: skip
    core, executor = runner.core, runner.executor
    assert core.layout.host_models == ("A",)
    assert set(executor.host_weights) == {"A"}
    ptr = executor.region.data_ptr()
    now, reads, threads = 0.0, [], []
    read_into = files.read_into

    def recorded(model: str, *args: Any) -> bool:
        threads.append(f"{model}: {threading.current_thread().name}")
        return read_into(model, *args)

    files.read_into = recorded  # type: ignore[method-assign,assignment]
    for rnd, model in enumerate("ABCA"):
        prompt = prompt_ids(13 + rnd, seed=40 + rnd)
        runner.submit(call(f"s{rnd}", 0, model, prompt, 6), now)
        now = run_until_idle(runner, now, ptr) + 1.0
        assert list(runner.take_output((sk(f"s{rnd}"), 0))) == reference(hfs[model], prompt, 6)
        held = {m for m in hfs if core.arena.on_host(m)}
        assert executor.host_models == held, (model, held)
        while executor._stager is not None and not executor._stager.done:
            time.sleep(0.01)  # a stage's read may still run on its thread: count it read
        reads.append(files.reads)
    assert reads == reads_after
    assert files.bytes_read == sum(core.layout.weights_of(m) for m in read)
    assert core.counters.cold_loads == len(read)
    assert (executor.sync_reads, executor.waited_reads, files.stopped_reads) == (0, 0, 0)
    assert threads == ["B: MainThread", "C: MainThread", "A: MainThread"]  # switches' reads
    assert_clean(runner)


@pytest.mark.parametrize("background", [False, True])
def test_a_stage_reads_its_file_on_the_reader(tmp_path: Path, background: bool) -> None:
    """A host weight budget of two models and three: A and B start on host. A's and C's
    calls arrive together; while A runs, C (waiting) is staged: read from disk, on the
    reader when stages run apart, dropping B's host copy (no work here). C's switch then
    reads nothing; every answer is transformers' own."""
    hfs = {"A": llama(11), "B": qwen2(12), "C": llama(13)}
    files = on_disk(hfs, tmp_path)
    archs = [ModelArch.from_hf_config(hf.config.to_dict()) for hf in hfs.values()]
    sizes = [a.weight_bytes(F32) for a in archs]
    per_token = max(a.kv_bytes_per_token(F32) for a in archs)
    host = 2 * sum(sizes) + 64 * BLOCK * per_token  # make_runner's host memory
    share = (sum(sizes) - min(sizes) // 2) / host  # any two copies fit, not three
    runner = make_runner(
        hfs, device_blocks=40, host_weight_share=share, weight_files=files,
        background_staging=background,
    )  # fmt: skip
    core, executor = runner.core, runner.executor
    assert core.layout.host_models == ("A", "B")
    threads = []
    read_into = files.read_into

    def recorded(model: str, *args: Any) -> bool:
        threads.append(f"{model}: {threading.current_thread().name}")
        return read_into(model, *args)

    files.read_into = recorded  # type: ignore[method-assign,assignment]
    prompts = {m: prompt_ids(13 + k, seed=40 + k) for k, m in enumerate("AC")}
    for model, prompt in prompts.items():
        runner.submit(call(f"s{model}", 0, model, prompt, 6), 0.0)
    run_until_idle(runner, 0.0, executor.region.data_ptr())
    for model, prompt in prompts.items():
        assert list(runner.take_output((sk(f"s{model}"), 0))) == reference(hfs[model], prompt, 6)
    assert threads == [f"C: {'weights-read_0' if background else 'MainThread'}"]
    assert (files.reads, files.bytes_read) == (1, core.layout.weights_of("C"))
    assert core.counters.cold_loads == 1 and core.counters.staged_switches == 1
    assert executor.host_models == {"A", "C"} == {m for m in hfs if core.arena.on_host(m)}
    assert (executor.sync_reads, executor.waited_reads, files.stopped_reads) == (0, 0, 0)
    assert_clean(runner)


def test_a_restart_with_weight_files_holds_the_starting_host_copies(tmp_path: Path) -> None:
    hfs = {"A": llama(14), "B": qwen2(15)}
    files = on_disk(hfs, tmp_path)
    runner = make_runner(hfs, device_blocks=40, host_weight_share=0.01, weight_files=files)
    runner.generate([call("s", 0, "B", prompt_ids(9, seed=3), 2)])
    assert set(runner.executor.host_weights) == {"B"}
    runner.executor.restart(runner.core.layout)
    assert set(runner.executor.host_weights) == {"A"} and files.reads == 2


def test_weight_files_refuse_a_wrong_size_or_a_missing_model(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path)
    flat = torch.arange(64, dtype=torch.uint8)
    files.write("m", flat)
    assert files.has("m", 64) and not files.has("other", 1)
    assert torch.equal(files.read("m", 64), flat)
    with pytest.raises(ConfigError, match="needs 65 bytes"):
        files.read("m", 65)
    with pytest.raises(ConfigError, match="no weight file"):
        files.read("other", 64)
    with pytest.raises(ConfigError, match="cannot name"):
        files.path("../m")
    with pytest.raises(ConfigError, match="flat uint8"):
        files.write("f", torch.zeros(4))
    assert files.reads == 1 and files.bytes_read == 64
    with pytest.raises(ConfigError, match="flat uint8"):
        files.read_into("m", torch.zeros(64))


def test_a_weight_file_read_stops_between_chunks_when_told(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path)
    flat = torch.randint(0, 256, (2 * READ_CHUNK_BYTES + 3,), dtype=torch.uint8)
    files.write("m", flat)
    out = torch.zeros_like(flat)
    checks = iter([False, True])  # the first chunk is read, then the read is told to stop
    assert not files.read_into("m", out, lambda: next(checks))
    assert torch.equal(out[:READ_CHUNK_BYTES], flat[:READ_CHUNK_BYTES])
    assert not bool(out[READ_CHUNK_BYTES:].any())
    assert (files.reads, files.stopped_reads, files.bytes_read) == (0, 1, READ_CHUNK_BYTES)
    assert files.read_into("m", out, lambda: False) and torch.equal(out, flat)
    assert (files.reads, files.stopped_reads) == (1, 1)


def test_weight_reads_run_on_a_reader_in_order_and_a_dropped_one_is_not_kept(
    tmp_path: Path,
) -> None:
    files = WeightFiles(tmp_path)
    flats = {m: torch.randint(0, 256, (3 * READ_CHUNK_BYTES + i,), dtype=torch.uint8)
             for i, m in enumerate("mnp")}  # fmt: skip
    for m, flat in flats.items():
        files.write(m, flat)
    threads: list[str] = []
    read_into = files.read_into

    def recorded(model: str, *args: Any) -> bool:
        threads.append(threading.current_thread().name)
        return read_into(model, *args)

    files.read_into = recorded  # type: ignore[method-assign,assignment]
    reads = WeightReads(files)
    for m in "mn":
        reads.start(m, flats[m].numel())
    with pytest.raises(RuntimeError, match="already pending"):
        reads.start("m", flats["m"].numel())
    n = reads.wait("n")  # after m's: one reader, reads in order
    assert n is not None and torch.equal(n, flats["n"])
    taken = reads.take_done()
    assert list(taken) == ["m"] and torch.equal(taken["m"], flats["m"])
    assert reads.pending == frozenset() and threads == ["weights-read_0"] * 2
    reads.start("p", flats["p"].numel())
    reads.drop("p")
    assert reads.pending == frozenset() and reads.wait("p") is None
    reads._pool.shutdown(wait=True)  # type: ignore[union-attr]
    assert files.reads + files.stopped_reads == 3  # p's: never started, stopped, or whole


def test_a_host_copy_the_arena_drops_is_not_kept_even_while_it_is_read(tmp_path: Path) -> None:
    """A stage's read still under way when a later plan drops that host copy (the stage was
    abandoned, the next one needs the room) is stopped and never held: the runner's host
    copies stay the arena's."""
    hfs = {"A": llama(16), "B": qwen2(17)}
    files = on_disk(hfs, tmp_path)
    executor = make_runner(hfs, device_blocks=40, host_weight_share=0.01, weight_files=files)
    runner = executor.executor
    reads = runner._reads
    assert reads is not None
    reads.start("B", executor.core.layout.weights_of("B"))
    assert runner.host_models == {"A", "B"}
    plan = SwitchPlan("A", (), 0, host_drops=("B",))
    runner._drop_host(plan)
    assert runner.host_models == {"A"}
    runner._take_reads()
    assert set(runner.host_weights) == {"A"}


def test_a_stage_of_a_model_still_being_read_waits_on_the_stage_thread(tmp_path: Path) -> None:
    """An abandoned stage's read of B goes on; B staged again (the arena counts it on host,
    so the plan reads nothing) joins that read on the stage thread instead of waiting for
    it on the step's, and the copy lands."""
    hfs = {"A": llama(18), "B": qwen2(19)}
    files = on_disk(hfs, tmp_path)
    executor = make_runner(hfs, device_blocks=40, host_weight_share=0.01, weight_files=files)
    runner, layout = executor.executor, executor.core.layout
    reads = runner._reads
    assert reads is not None
    buf, read = reads.start("B", layout.weights_of("B"))
    assert reads.start_or_join("B", layout.weights_of("B")) == (buf, read)
    nbytes = 4 * layout.block_bytes
    plan = SwitchPlan("B", (CopyStep("B", Link.HOST_TO_DEVICE, nbytes),), 1)
    runner._stage(plan, (0, 1, 2, 3), nbytes)
    assert runner.waited_reads == 0 and runner.sync_reads == 0 and files.reads <= 1
    stager = runner._stager
    assert stager is not None
    stager.wait()
    flat_b = flatten_weights("B", runner.archs["B"], hfs["B"].state_dict(), F32)
    assert torch.equal(runner._block_rows[0:4].flatten()[:nbytes], flat_b[:nbytes])
    runner._take_reads()
    assert files.reads == 1 and torch.equal(runner.host_weights["B"], flat_b)
