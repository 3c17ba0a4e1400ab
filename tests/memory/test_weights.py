"""Weight arena: exact plans on tiny models, typed errors, and a random-operation state machine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from talaria.config import ModelSpec
from talaria.errors import BadRequest, ConfigError, UnknownModel
from talaria.memory.weights import (
    ArenaIntegrityError,
    ArenaRefused,
    CopyStep,
    SwitchPlan,
    WeightArena,
)
from talaria.types import Link, Residency
from tests.helpers import examples, tiny_spec

D2H, H2D, D2D = Link.DISK_TO_HOST, Link.HOST_TO_DEVICE, Link.DEVICE_TO_DEVICE


def spec(name: str, nbytes: int) -> ModelSpec:
    """A model whose weights are exactly ``nbytes`` bytes (one byte per parameter)."""
    return tiny_spec(name, nbytes)


MODELS = (spec("a", 100), spec("b", 60), spec("c", 80))
SIZES = {m.name: m.weight_bytes for m in MODELS}


def arena(**kwargs: Any) -> WeightArena:
    kwargs.setdefault("host_weight_bytes", 1000)
    return WeightArena(MODELS, **kwargs)


def snapshot(w: WeightArena) -> tuple[object, ...]:
    """Everything observable through the public API."""
    per_model = tuple((w.residency(m), w.region_of(m), w.on_host(m)) for m in w.models)
    return per_model, w.active_model, w.staged_model, w.staging_in_progress, repr(w)


def test_layout_offsets_and_sizes() -> None:
    w = arena(n_regions=2)
    assert (w.region_bytes, w.arena_bytes, w.staged_bytes) == (100, 200, 0)
    assert [w.region_offset(r) for r in range(2)] == [0, 100]
    flat = arena(n_regions=2, staging=False)
    assert flat.arena_bytes == 200  # staging borrows KV memory: it reserves nothing
    with pytest.raises(BadRequest, match=r"out of range 0\.\.1"):
        flat.region_offset(2)


def test_partial_stage_switches_the_rest_from_host() -> None:
    w = arena(n_regions=1, initially_on_host=["a", "b", "c"])
    w.switch("a")
    plan = w.start_stage("b", 45)
    assert plan.steps == (CopyStep("b", H2D, 45),)
    assert w.staged_bytes == 45
    w.finish_stage("b")
    switch = w.switch("b")
    assert switch.steps == (CopyStep("b", D2D, 45), CopyStep("b", H2D, 15))
    assert w.staged_bytes == 0 and w.staged_model is None
    with pytest.raises(BadRequest):
        w.plan_stage("c", 81)  # more than the model
    w.check_integrity()
    assert w.models == ("a", "b", "c")
    w.check_integrity()


def test_plan_per_residency() -> None:
    w = arena(n_regions=2, initially_on_host=["c"])
    assert w.residency("b") is Residency.COLD
    cold = w.plan_switch("b")
    assert cold.steps == (CopyStep("b", D2H, 60), CopyStep("b", H2D, 60))
    assert (cold.total_bytes, cold.bytes_by_link) == (120, {D2H: 60, H2D: 60})
    assert (cold.region, cold.evicts, cold.evicted_to, cold.host_drops) == (0, None, None, ())
    assert w.residency("c") is Residency.HOST
    assert w.plan_switch("c").steps == (CopyStep("c", H2D, 80),)
    w.start_stage("b")
    w.finish_stage("b")
    assert w.residency("b") is Residency.STAGED
    assert w.plan_switch("b") == SwitchPlan("b", (CopyStep("b", D2D, 60),), region=0)
    w.switch("c")
    assert w.residency("c") is Residency.ACTIVE
    assert w.plan_switch("c") == SwitchPlan("c", (), region=0)
    w.deactivate()
    assert w.residency("c") is Residency.RESIDENT
    assert w.plan_switch("c").total_bytes == 0


def test_switch_sequence_keeps_previous_active_resident() -> None:
    w = arena(n_regions=2)
    assert w.switch("a").region == 0
    assert w.switch("b").region == 1
    assert (w.residency("a"), w.residency("b"), w.active_model) == (
        Residency.RESIDENT,
        Residency.ACTIVE,
        "b",
    )
    plan = w.switch("a")
    assert (plan.steps, plan.region, w.active_model) == ((), 0, "a")
    # All regions full: c evicts the non-active owner b, which keeps its host copy.
    plan = w.switch("c")
    assert (plan.region, plan.evicts, plan.evicted_to) == (1, "b", Residency.HOST)
    assert plan.bytes_by_link == {D2H: 80, H2D: 80}
    assert (w.region_of("b"), w.residency("b"), w.residency("a")) == (
        None,
        Residency.HOST,
        Residency.RESIDENT,
    )
    assert w.plan_switch("b").steps == (CopyStep("b", H2D, 60),)
    w.check_integrity()


def test_vacate_empties_the_device_and_keeps_the_host_copies() -> None:
    w = arena(n_regions=1, host_weight_bytes=200, initially_on_host=("a", "b"))
    w.switch("a")
    w.switch("b")  # a leaves the region, keeps its host copy
    w.start_stage("a")  # a stage in progress goes with the device too
    assert w.vacate() == ("b",)
    assert (w.active_model, w.staged_model, w.staging_in_progress, w.staged_bytes) == (
        None,
        None,
        None,
        0,
    )
    assert [w.residency(m) for m in "abc"] == [Residency.HOST, Residency.HOST, Residency.COLD]
    assert w.plan_switch("b").steps == (CopyStep("b", H2D, 60),)  # back from host only
    w.switch("c")  # from disk: its host copy drops b's (least recently used)
    assert w.vacate() == ("c",)
    assert [w.residency(m) for m in "abc"] == [Residency.HOST, Residency.COLD, Residency.HOST]
    assert w.vacate() == ()
    w.check_integrity()


def test_region_eviction_is_lru_not_load_order() -> None:
    w = arena(n_regions=2)
    w.switch("a")
    w.switch("b")
    w.switch("a")
    w.deactivate()
    assert w.plan_switch("c").evicts == "b"
    w.switch("b")
    assert w.plan_switch("c").evicts == "a"  # b is active and most recent: a is LRU


def test_single_region_evicts_the_active_model() -> None:
    w = arena(n_regions=1)
    w.switch("a")
    plan = w.switch("b")
    assert (plan.region, plan.evicts, plan.evicted_to) == (0, "a", Residency.HOST)
    assert (w.residency("a"), w.active_model) == (Residency.HOST, "b")


def test_host_copies_evicted_lru() -> None:
    w = arena(n_regions=1, host_weight_bytes=160)
    w.switch("a")
    w.switch("b")
    assert w.host_bytes_used == 160
    plan = w.switch("c")  # needs 80 more bytes: drops a (LRU); b keeps its copy
    assert (plan.host_drops, plan.evicts, plan.evicted_to) == (("a",), "b", Residency.HOST)
    assert (w.residency("a"), w.on_host("b"), w.on_host("c")) == (Residency.COLD, True, True)
    assert w.host_bytes_used == 140
    w.check_integrity()


def test_evicted_model_without_host_copy_goes_cold() -> None:
    w = arena(n_regions=1, host_weight_bytes=100)
    w.switch("a")
    plan = w.switch("b")
    assert (plan.host_drops, plan.evicts, plan.evicted_to) == (("a",), "a", Residency.COLD)
    assert (w.residency("a"), w.on_host("a"), w.host_bytes_used) == (Residency.COLD, False, 60)


def test_resident_model_survives_losing_its_host_copy() -> None:
    w = arena(n_regions=2, host_weight_bytes=100)
    w.switch("a")
    w.switch("b")  # drops a's host copy; a stays in region 0
    assert (w.residency("a"), w.on_host("a"), w.region_of("a")) == (Residency.RESIDENT, False, 0)
    assert w.switch("a").total_bytes == 0
    plan = w.switch("c")  # evicts b, whose host copy made room for c's: b goes cold
    assert (plan.evicts, plan.host_drops, plan.evicted_to) == ("b", ("b",), Residency.COLD)


def test_staging_lifecycle() -> None:
    w = arena(n_regions=1)
    w.switch("a")
    plan = w.start_stage("b")
    assert plan == SwitchPlan("b", (CopyStep("b", D2H, 60), CopyStep("b", H2D, 60)), region=1)
    assert (w.staging_in_progress, w.staged_model, w.residency("b")) == ("b", None, Residency.HOST)
    assert not w.can_switch("b")
    with pytest.raises(ArenaRefused, match="still being staged"):
        w.switch("b")
    w.finish_stage("b")
    assert (w.staging_in_progress, w.staged_model, w.residency("b")) == (
        None,
        "b",
        Residency.STAGED,
    )
    assert not w.can_stage("b")
    plan = w.switch("b")
    assert plan.steps == (CopyStep("b", D2D, 60),)
    assert (plan.region, plan.evicts, plan.evicted_to) == (0, "a", Residency.HOST)
    assert (w.staged_model, w.staging_in_progress, w.residency("b")) == (
        None,
        None,
        Residency.ACTIVE,
    )
    w.check_integrity()


def test_new_stage_displaces_previous_and_cancel_empties() -> None:
    w = arena(n_regions=1, initially_on_host=["b"])
    assert w.start_stage("b").steps == (CopyStep("b", H2D, 60),)
    w.finish_stage("b")
    plan = w.start_stage("c")
    assert (plan.evicts, plan.evicted_to, w.staging_in_progress) == ("b", Residency.HOST, "c")
    assert w.residency("b") is Residency.HOST
    w.cancel_stage()
    assert (w.staged_model, w.staging_in_progress, w.residency("c")) == (None, None, Residency.HOST)
    w.cancel_stage()  # no-op on an empty staging area
    w.check_integrity()


def test_staging_refusals() -> None:
    w = arena(n_regions=1)
    w.switch("a")
    assert not w.can_stage("a")
    with pytest.raises(ArenaRefused, match="already in region 0"):
        w.plan_stage("a")
    w.start_stage("b")
    assert not w.can_stage("b")
    before = snapshot(w)
    with pytest.raises(ArenaRefused, match="c is not being staged"):
        w.finish_stage("c")
    assert snapshot(w) == before
    flat = arena(staging=False)
    assert not any(flat.can_stage(m) for m in flat.models)
    with pytest.raises(ArenaRefused, match="disabled"):
        flat.start_stage("b")


def test_host_copy_of_model_being_staged_is_pinned() -> None:
    w = arena(n_regions=1, host_weight_bytes=100)
    w.start_stage("b")
    before = snapshot(w)
    assert not w.can_switch("a")  # a needs 100 host bytes; only b's pinned copy could go
    with pytest.raises(ArenaRefused, match="while b is being staged"):
        w.switch("a")
    assert snapshot(w) == before
    w.finish_stage("b")
    plan = w.switch("a")
    assert (plan.host_drops, w.residency("b"), w.on_host("b")) == (("b",), Residency.STAGED, False)
    w.check_integrity()


@pytest.mark.parametrize(("n_regions", "offsets"), [(1, [0, 0, 0]), (3, [0, 100, 200])])
def test_region_offsets_stable_across_switches(n_regions: int, offsets: list[int]) -> None:
    w = arena(n_regions=n_regions)
    for i in range(10):
        plan = w.switch(w.models[i % 3])
        assert w.region_offset(plan.region) == offsets[i % 3]
        later = 0 if n_regions == 3 else SIZES[plan.model]  # resident, or reloaded from host
        assert plan.total_bytes == (2 * SIZES[plan.model] if i < 3 else later)
    assert [w.region_offset(r) for r in range(n_regions)] == offsets[:n_regions]


def test_plans_do_not_mutate() -> None:
    w = arena(n_regions=1, host_weight_bytes=160)
    w.switch("a")
    w.start_stage("b")
    before = snapshot(w)
    for m in w.models:
        w.can_switch(m)
        w.can_stage(m)
    w.plan_switch("c")
    assert snapshot(w) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_regions": 0}, "n_regions must be a positive integer"),
        ({"n_regions": True}, "n_regions must be a positive integer"),
        ({"staging": 1}, "staging must be True or False"),
        ({"host_weight_bytes": -1}, "host_weight_bytes must be an integer >= 0"),
        ({"host_weight_bytes": 99}, "model a needs 100 bytes of host memory"),
        ({"initially_on_host": ["z"]}, r"unknown models \['z'\]"),
        ({"initially_on_host": "a"}, "not a str"),
        ({"host_weight_bytes": 150, "initially_on_host": ["a", "b"]}, "needs 160 bytes"),
    ],
)
def test_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        arena(**kwargs)


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ((), "at least one model"),
        ((spec("a", 10), spec("a", 20)), "'a' appears twice"),
        (("a",), "must be ModelSpec"),
        ((attrs.evolve(spec("a", 10), dtype_bytes=0.01),), "model a has no weight bytes"),
    ],
)
def test_model_list_errors(models: tuple[ModelSpec, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WeightArena(models, host_weight_bytes=100)


def test_unknown_model_leaves_state_unchanged() -> None:
    w = arena()
    w.switch("a")
    before = snapshot(w)
    calls: list[Callable[[str], object]] = [w.residency, w.region_of, w.on_host, w.spec]
    calls += [w.plan_switch, w.can_switch, w.switch]
    calls += [w.plan_stage, w.can_stage, w.start_stage, w.finish_stage]
    for call in calls:
        with pytest.raises(UnknownModel, match="unknown model 'zzz'"):
            call("zzz")
    assert snapshot(w) == before


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda w: w._regions.__setitem__(1, "a"), "a model is in two regions"),
        (lambda w: w._region_of.__setitem__("b", 0), "two models own one region"),
        (lambda w: setattr(w, "_active", "c"), "active model c owns no region"),
        (lambda w: setattr(w, "_staged", "a"), "staged model a is also resident"),
        (lambda w: setattr(w, "_staged", "c"), "c is being staged without a host copy"),
        (lambda w: w._host.update({"b", "c"}), "host copies use 240 > 200"),
        (lambda w: w._host.add("zzz"), "unknown models in the tables"),
    ],
)
def test_check_integrity_detects_corruption(
    corrupt: Callable[[WeightArena], object], message: str
) -> None:
    w = arena(n_regions=2, host_weight_bytes=200)
    w.switch("a")
    w.check_integrity()
    corrupt(w)
    with pytest.raises(ArenaIntegrityError, match=message):
        w.check_integrity()


class ArenaMachine(RuleBasedStateMachine):
    """Random switch / stage / finish / cancel / deactivate sequences on three models."""

    arena: WeightArena

    @initialize(
        n_regions=st.integers(1, 3),
        staging=st.booleans(),
        host=st.integers(100, 260),
        on_host=st.sets(st.sampled_from(["a", "b", "c"]), max_size=1),
    )
    def setup(self, n_regions: int, staging: bool, host: int, on_host: set[str]) -> None:
        self.arena = arena(
            n_regions=n_regions, staging=staging, host_weight_bytes=host, initially_on_host=on_host
        )

    @rule(model=st.sampled_from(["a", "b", "c"]))
    def switch(self, model: str) -> None:
        w = self.arena
        if not w.can_switch(model):
            before = snapshot(w)
            with pytest.raises(ArenaRefused):
                w.switch(model)
            assert snapshot(w) == before
            return
        was = w.residency(model)
        plan = w.plan_switch(model)
        assert w.switch(model) == plan
        assert w.residency(model) is Residency.ACTIVE and w.active_model == model
        expected = {
            Residency.ACTIVE: {},
            Residency.RESIDENT: {},
            Residency.STAGED: {D2D: SIZES[model]},
            Residency.HOST: {H2D: SIZES[model]},
            Residency.COLD: {D2H: SIZES[model], H2D: SIZES[model]},
        }[was]
        assert plan.bytes_by_link == expected
        if plan.evicts is not None:
            assert w.residency(plan.evicts) is plan.evicted_to

    @rule(model=st.sampled_from(["a", "b", "c"]))
    def stage(self, model: str) -> None:
        w = self.arena
        if not w.can_stage(model):
            before = snapshot(w)
            with pytest.raises(ArenaRefused):
                w.start_stage(model)
            assert snapshot(w) == before
            return
        plan = w.start_stage(model)
        assert plan.region == w.n_regions and w.staging_in_progress == model
        assert plan.total_bytes in (SIZES[model], 2 * SIZES[model])

    @rule()
    def finish(self) -> None:
        if (model := self.arena.staging_in_progress) is not None:
            self.arena.finish_stage(model)
            assert self.arena.residency(model) is Residency.STAGED

    @rule()
    def cancel(self) -> None:
        self.arena.cancel_stage()

    @rule()
    def deactivate(self) -> None:
        self.arena.deactivate()
        assert self.arena.active_model is None

    @rule()
    def vacate(self) -> None:
        w = self.arena
        host = {m: w.on_host(m) for m in w.models}
        placed = tuple(m for m in w.models if w.region_of(m) is not None)
        assert sorted(w.vacate()) == sorted(placed)
        for m in w.models:
            assert w.on_host(m) == host[m]
            assert w.residency(m) is (Residency.HOST if host[m] else Residency.COLD)

    @invariant()
    def consistent(self) -> None:
        w = self.arena
        w.check_integrity()
        residencies = [w.residency(m) for m in w.models]
        assert residencies.count(Residency.ACTIVE) <= 1
        assert residencies.count(Residency.ACTIVE) == (w.active_model is not None)
        assert residencies.count(Residency.STAGED) == (w.staged_model is not None)
        assert sum(r in (Residency.ACTIVE, Residency.RESIDENT) for r in residencies) <= w.n_regions
        assert w.host_bytes_used <= w.host_weight_bytes
        for m in w.models:
            if w.can_switch(m):
                assert w.plan_switch(m).total_bytes >= 0


ArenaMachine.TestCase.settings = settings(
    max_examples=examples(200), stateful_step_count=40, deadline=None
)
TestArenaMachine = ArenaMachine.TestCase


@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=30))
def test_random_switches_keep_regions_fixed_per_slot(sequence: list[str]) -> None:
    w = arena(n_regions=2)
    for model in sequence:
        plan = w.switch(model)
        assert w.region_offset(plan.region) == plan.region * w.region_bytes
        assert w.region_of(model) == plan.region
    w.check_integrity()
