"""Weight arena of one instance: which model's weights sit in which fixed device region.

Pure accounting: no torch, no I/O, no clock. Device memory for weights is reserved once,
as ``n_regions`` execution regions of ``region_bytes`` (the largest model's weights) at fixed
offsets::

    0              region_bytes        ...   n_regions * region_bytes
    | region 0     | region 1          ...   |

Staging reserves nothing: the next model's weights are copied (host -> device) into device
memory the KV pool lends while it is free, as much of the model as the loan holds
(``start_stage(model, nbytes)``). The switch then copies the staged part device -> device
into the model's region and only the rest from host. A staging area that took a whole
region of its own would cost the KV pool more than it saves when slots are long.

A model loaded into region ``i`` always starts at ``region_offset(i)``, so a real engine that
maps each region to one slice of a preallocated tensor sees stable data pointers. Behind the
device sits a budget of host memory for weight copies (``host_weight_bytes``), evicted least
recently used. Every model reaches the device through host memory (disk -> host -> device);
evicting a model from the device copies nothing back, since weights are read-only.

Sizes are bytes. Recency counts switches and stages (a model is "used" when it is switched
to or staged); it is not time. Every mutating method checks before it changes anything, so a
refused or bad call leaves the arena as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import Final

import attrs

from talaria import validators as valid
from talaria.config import ModelSpec
from talaria.errors import BadRequest, ConfigError, TalariaError, UnknownModel
from talaria.types import Link, Residency


class ArenaRefused(TalariaError, RuntimeError):
    """A switch or stage that the matching ``can_*`` check refuses (a caller skipped it)."""

    code = "weight_arena_refused"


class ArenaIntegrityError(TalariaError, RuntimeError):
    """The arena's tables contradict each other: a bug in Talaria, never bad input."""

    code = "weight_arena_integrity"


@attrs.frozen
class CopyStep:
    """Copy ``nbytes`` bytes of ``model``'s weights over ``link``."""

    model: str
    link: Link
    nbytes: int


@attrs.frozen
class SwitchPlan:
    """What a switch or stage does: its copies, in order, and what it displaces.

    ``region`` is the destination slot: ``0 .. n_regions - 1`` an execution region,
    ``n_regions`` the staging area. ``evicts`` is the model whose device copy is overwritten
    (the region's owner, or the previous occupant of the staging area) and ``evicted_to`` its
    residency afterwards (HOST or COLD; nothing is copied back). ``host_drops`` are the host
    copies evicted, least recently used first, to make room for a copy loaded from disk.
    ``provision_s`` is how long the switch waits for its devices before the first copy: a
    switch that wakes an instance that scaled to zero (the slot control sets it; the arena's
    plans have 0).
    """

    model: str
    steps: tuple[CopyStep, ...]
    region: int
    evicts: str | None = None
    evicted_to: Residency | None = None
    host_drops: tuple[str, ...] = ()
    provision_s: float = attrs.field(default=0.0, validator=valid.non_negative)

    @property
    def total_bytes(self) -> int:
        """Bytes copied over all links."""
        return sum(step.nbytes for step in self.steps)

    @property
    def bytes_by_link(self) -> dict[Link, int]:
        """Bytes copied per link; links the plan does not use are absent."""
        out: dict[Link, int] = {}
        for step in self.steps:
            out[step.link] = out.get(step.link, 0) + step.nbytes
        return out


def _validated_specs(
    models: Sequence[ModelSpec], n_regions: int, staging: bool, host_weight_bytes: int
) -> dict[str, ModelSpec]:
    if isinstance(n_regions, bool) or not isinstance(n_regions, int) or n_regions < 1:
        raise ConfigError(f"n_regions must be a positive integer, got {n_regions!r}")
    if not isinstance(staging, bool):
        raise ConfigError(f"staging must be True or False, got {staging!r}")
    if (
        isinstance(host_weight_bytes, bool)
        or not isinstance(host_weight_bytes, int)
        or host_weight_bytes < 0
    ):
        raise ConfigError(f"host_weight_bytes must be an integer >= 0, got {host_weight_bytes!r}")
    if not models:
        raise ConfigError("a weight arena needs at least one model")
    specs: dict[str, ModelSpec] = {}
    for spec in models:
        if not isinstance(spec, ModelSpec):
            raise ConfigError(f"models must be ModelSpec instances, got {spec!r}")
        if spec.name in specs:
            raise ConfigError(f"model names must be unique; {spec.name!r} appears twice")
        if spec.weight_bytes < 1:
            raise ConfigError(f"model {spec.name} has no weight bytes (total_params * dtype_bytes)")
        if spec.weight_bytes > host_weight_bytes:
            raise ConfigError(
                f"model {spec.name} needs {spec.weight_bytes} bytes of host memory to load from "
                f"disk but host_weight_bytes is {host_weight_bytes}; raise it or drop the model"
            )
        specs[spec.name] = spec
    return specs


class WeightArena:
    """Device regions, staging area and host copies of one instance's model weights.

    Residency of a model (``residency``): ACTIVE (in a region, its slot runs; at most one),
    RESIDENT (in a region), STAGED (fully copied into the staging area), HOST (host copy
    only) or COLD (disk only). A model on the device may also have a host copy (``on_host``).
    A model being copied into the staging area (``staging_in_progress``) is still HOST, and
    its host copy is never evicted until ``finish_stage`` or ``cancel_stage``.
    """

    def __init__(
        self,
        models: Sequence[ModelSpec],
        *,
        n_regions: int = 1,
        staging: bool = True,
        host_weight_bytes: int,
        initially_on_host: Iterable[str] = (),
    ) -> None:
        self._specs = _validated_specs(models, n_regions, staging, host_weight_bytes)
        if isinstance(initially_on_host, str):
            raise ConfigError("initially_on_host must be a collection of model names, not a str")
        host = set(initially_on_host)
        if unknown := sorted(host - self._specs.keys()):
            raise ConfigError(f"initially_on_host names unknown models {unknown}")
        if (used := sum(self._specs[m].weight_bytes for m in host)) > host_weight_bytes:
            raise ConfigError(
                f"initially_on_host needs {used} bytes but host_weight_bytes is {host_weight_bytes}"
            )
        self.n_regions: Final = n_regions
        self.staging: Final = staging
        self.host_weight_bytes: Final = host_weight_bytes
        self.region_bytes: Final = max(spec.weight_bytes for spec in self._specs.values())
        self._regions: list[str | None] = [None] * n_regions  # region -> owner
        self._region_of: dict[str, int] = {}  # owner -> region (the same table, inverted)
        self._active: str | None = None
        self._staged: str | None = None  # occupant of the staging area
        self._stage_ready = False
        self._staged_bytes = 0
        self._host = host
        # Distinct negative starting values: never-used models are LRU in the order given.
        self._last_used = {name: i - len(self._specs) for i, name in enumerate(self._specs)}
        self._tick = 0
        self._changes = 0  # commits so far (``changes``)

    def __repr__(self) -> str:
        staged = f"{self._staged}{'' if self._stage_ready else ' (in progress)'}"
        return (
            f"WeightArena(regions={self._regions}, active={self._active}, "
            f"staging={staged if self._staged else None}, host={sorted(self._host)})"
        )

    # ----- layout and queries (no mutation) ---------------------------------------------

    @property
    def models(self) -> tuple[str, ...]:
        """Names of the models this arena may hold, in the order given."""
        return tuple(self._specs)

    @property
    def arena_bytes(self) -> int:
        """Device bytes reserved for weights: the execution regions (staging is borrowed)."""
        return self.n_regions * self.region_bytes

    @property
    def staged_bytes(self) -> int:
        """Bytes of the staged (or staging) model copied into borrowed device memory."""
        return self._staged_bytes if self._staged is not None else 0

    def region_offset(self, region: int) -> int:
        """Byte offset of execution region ``region``."""
        if isinstance(region, bool) or not isinstance(region, int):
            raise BadRequest(f"region must be an integer, got {region!r}")
        if not 0 <= region < self.n_regions:
            raise BadRequest(f"region {region} is out of range 0..{self.n_regions - 1}")
        return region * self.region_bytes

    @property
    def changes(self) -> int:
        """How many commits the arena has made: an unchanged count means an unchanged arena,
        so it keys memos of values derived from it (switch times)."""
        return self._changes

    @property
    def active_model(self) -> str | None:
        return self._active

    @property
    def staged_model(self) -> str | None:
        """The model fully copied into the staging area, ready to switch to."""
        return self._staged if self._stage_ready else None

    @property
    def staging_in_progress(self) -> str | None:
        """The model whose copy into the staging area has started but not finished."""
        return None if self._stage_ready else self._staged

    @property
    def host_bytes_used(self) -> int:
        return sum(self._specs[name].weight_bytes for name in self._host)

    def spec(self, model: str) -> ModelSpec:
        """The model's spec; raises ``UnknownModel`` for a name this arena does not hold."""
        spec = self._specs.get(model)
        if spec is None:
            raise UnknownModel(f"unknown model {model!r}; this arena holds {list(self._specs)}")
        return spec

    def residency(self, model: str) -> Residency:
        self.spec(model)
        if model == self._active:
            return Residency.ACTIVE
        if model in self._region_of:
            return Residency.RESIDENT
        if model == self.staged_model:
            return Residency.STAGED
        return Residency.HOST if model in self._host else Residency.COLD

    def region_of(self, model: str) -> int | None:
        """The execution region holding ``model``, or None if it is not in one."""
        self.spec(model)
        return self._region_of.get(model)

    def on_host(self, model: str) -> bool:
        """Whether a copy of ``model``'s weights is in host memory."""
        self.spec(model)
        return model in self._host

    # ----- planning (no mutation) -------------------------------------------------------

    def plan_switch(self, model: str) -> SwitchPlan:
        """Copies and evictions that make ``model`` ACTIVE; raises ``ArenaRefused`` if it cannot.

        Nothing to copy if it is in a region; staging area -> its region if STAGED; host ->
        device if it has a host copy; else disk -> host -> device. A model off the device goes
        to the lowest free region, else evicts the least recently used owner that is not
        active (the active one only when it owns the only region).
        """
        self.spec(model)
        if model in self._region_of:
            return SwitchPlan(model, (), self._region_of[model])
        if model == self.staging_in_progress:
            raise ArenaRefused(f"{model} is still being staged; finish_stage or cancel_stage first")
        from_staging = model == self.staged_model
        drops = () if from_staging else self._host_drops(model, self.staging_in_progress)
        region, victim = self._target_region()
        steps = self._load_steps(model, from_staging)
        return SwitchPlan(model, steps, region, victim, self._fate(victim, drops), drops)

    def can_switch(self, model: str) -> bool:
        try:
            self.plan_switch(model)
        except ArenaRefused:
            return False
        return True

    def plan_stage(self, model: str, nbytes: int | None = None) -> SwitchPlan:
        """Copies that stage ``nbytes`` of ``model`` (all of it by default) into borrowed
        device memory; raises ``ArenaRefused`` if refused.

        Refused when staging is disabled, the model is in a region, or it already occupies
        the staging area. The previous occupant of the staging area is displaced (``evicts``).
        """
        size = self._stage_size(model, nbytes)
        if not self.staging:
            raise ArenaRefused("staging is disabled on this arena")
        if model in self._region_of:
            raise ArenaRefused(f"{model} is already in region {self._region_of[model]}")
        if model == self._staged:
            raise ArenaRefused(f"{model} already occupies the staging area")
        drops = self._host_drops(model, protected=None)
        steps = self._load_steps(model, from_staging=False, nbytes=size)
        previous = self._staged
        return SwitchPlan(
            model, steps, self.n_regions, previous, self._fate(previous, drops), drops
        )

    def _stage_size(self, model: str, nbytes: int | None) -> int:
        full = self.spec(model).weight_bytes
        if nbytes is None:
            return full
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= full:
            raise BadRequest(f"stage bytes must be in 1..{full} for {model}, got {nbytes!r}")
        return nbytes

    def can_stage(self, model: str, nbytes: int | None = None) -> bool:
        try:
            self.plan_stage(model, nbytes)
        except ArenaRefused:
            return False
        return True

    def _load_steps(
        self, model: str, from_staging: bool, nbytes: int | None = None
    ) -> tuple[CopyStep, ...]:
        """Copies to bring ``nbytes`` (default: all) of ``model`` onto the device. From
        staging: the staged part device -> device, the rest host -> device."""
        full = self._specs[model].weight_bytes
        if from_staging:
            staged = self._staged_bytes
            d2d = CopyStep(model, Link.DEVICE_TO_DEVICE, staged)
            return (
                (d2d,)
                if staged >= full
                else (d2d, CopyStep(model, Link.HOST_TO_DEVICE, full - staged))
            )
        to_device = CopyStep(model, Link.HOST_TO_DEVICE, full if nbytes is None else nbytes)
        if model in self._host:
            return (to_device,)
        return (CopyStep(model, Link.DISK_TO_HOST, full), to_device)

    def _host_drops(self, model: str, protected: str | None) -> tuple[str, ...]:
        """Host copies to evict, LRU first, so that a copy of ``model`` fits."""
        if model in self._host:
            return ()
        excess = self.host_bytes_used + self._specs[model].weight_bytes - self.host_weight_bytes
        drops: list[str] = []
        for name in sorted(self._host - {protected}, key=self._last_used.__getitem__):
            if excess <= 0:
                break
            drops.append(name)
            excess -= self._specs[name].weight_bytes
        if excess > 0:
            raise ArenaRefused(
                f"host memory ({self.host_weight_bytes} bytes) cannot hold {model} while "
                f"{protected} is being staged; finish_stage or cancel_stage first"
            )
        return tuple(drops)

    def _target_region(self) -> tuple[int, str | None]:
        """Region for a model coming onto the device, and the owner it evicts (if any)."""
        if None in self._regions:
            return self._regions.index(None), None
        owners = [m for m in self._region_of if m != self._active] or list(self._region_of)
        victim = min(owners, key=self._last_used.__getitem__)
        return self._region_of[victim], victim

    def _fate(self, evicted: str | None, host_drops: tuple[str, ...]) -> Residency | None:
        if evicted is None:
            return None
        kept = evicted in self._host and evicted not in host_drops
        return Residency.HOST if kept else Residency.COLD

    # ----- commits (mutate; each checks first and raises before any change) --------------

    def switch(self, model: str) -> SwitchPlan:
        """Make ``model`` ACTIVE by committing ``plan_switch(model)``, which it returns.

        The previously active model stays RESIDENT in its region; the evicted model loses its
        region; a model loaded from disk keeps a host copy; a staged model frees the staging
        area. Raises ``ArenaRefused`` (state unchanged) where ``can_switch`` is False.
        """
        plan = self.plan_switch(model)
        self._apply_host(plan)
        if model == self._staged:
            self.cancel_stage()
        if plan.evicts is not None:
            del self._region_of[plan.evicts]
        self._regions[plan.region] = model
        self._region_of[model] = plan.region
        self._active = model
        self._touch(model)
        self._changes += 1
        return plan

    def deactivate(self) -> None:
        """The active model, if any, becomes RESIDENT (its slot ended); no-op otherwise."""
        self._active = None
        self._changes += 1

    def vacate(self) -> tuple[str, ...]:
        """Give the device back (the instance scales to zero): every region and the staging
        area empty, no model active. Host copies stay (host memory is the server's), so a
        model that has one becomes HOST and one without becomes COLD. Copies nothing (weights
        are read-only). Returns the models that were in a region, in region order."""
        left = tuple(m for m in self._regions if m is not None)
        self._regions = [None] * self.n_regions
        self._region_of.clear()
        self._active = None
        self._staged, self._stage_ready, self._staged_bytes = None, False, 0
        self._changes += 1
        return left

    def start_stage(self, model: str, nbytes: int | None = None) -> SwitchPlan:
        """Start copying ``nbytes`` of ``model`` (default all) into borrowed device memory;
        commits and returns ``plan_stage``.

        The previous occupant of the staging area is dropped from it. Until ``finish_stage``
        the model is ``staging_in_progress`` and its host copy is pinned.
        """
        plan = self.plan_stage(model, nbytes)
        self._apply_host(plan)
        self._staged, self._stage_ready = model, False
        self._staged_bytes = self._stage_size(model, nbytes)
        self._touch(model)
        self._changes += 1
        return plan

    def finish_stage(self, model: str) -> None:
        """The copy of ``model`` into the staging area is complete: it is now STAGED."""
        self.spec(model)
        if model != self.staging_in_progress:
            raise ArenaRefused(
                f"{model} is not being staged (in progress: {self.staging_in_progress})"
            )
        self._stage_ready = True
        self._changes += 1

    def cancel_stage(self) -> None:
        """Empty the staging area, abandoning a copy in progress; no-op if it is empty."""
        self._staged, self._stage_ready, self._staged_bytes = None, False, 0
        self._changes += 1

    def _apply_host(self, plan: SwitchPlan) -> None:
        self._host.difference_update(plan.host_drops)
        if any(step.link is Link.DISK_TO_HOST for step in plan.steps):
            self._host.add(plan.model)

    def _touch(self, model: str) -> None:
        self._tick += 1
        self._last_used[model] = self._tick

    # ----- integrity --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``ArenaIntegrityError`` naming every inconsistency found; mutates nothing."""
        problems = self._layout_problems() + self._table_problems()
        if problems:
            raise ArenaIntegrityError(f"{self!r}: " + "; ".join(problems))

    def _layout_problems(self) -> list[str]:
        problems: list[str] = []
        spans = sorted(
            (self.region_offset(r), self.region_offset(r) + self.region_bytes)
            for r in range(self.n_regions)
        )
        for (_, end), (start, _) in pairwise(spans):
            if start < end:
                problems.append(f"regions overlap at byte {start}")
        if spans[-1][1] > self.arena_bytes:
            problems.append(f"regions end at byte {spans[-1][1]} past arena_bytes")
        placed = [m for m in (*self._regions, self._staged) if m in self._specs]
        if too_big := [m for m in placed if self._specs[m].weight_bytes > self.region_bytes]:
            problems.append(f"models larger than a region are placed: {too_big}")
        return problems

    def _table_problems(self) -> list[str]:
        problems: list[str] = []
        owners = [m for m in self._regions if m is not None]
        if len(set(owners)) != len(owners):
            problems.append(f"a model is in two regions: {self._regions}")
        if len(set(self._region_of.values())) != len(self._region_of):
            problems.append(f"two models own one region: {self._region_of}")
        if {m: r for r, m in enumerate(self._regions) if m is not None} != self._region_of:
            problems.append(f"region table {self._regions} disagrees with {self._region_of}")
        if self._active is not None and self._active not in self._region_of:
            problems.append(f"active model {self._active} owns no region")
        if self._staged is not None and not self.staging:
            problems.append(f"{self._staged} is staged but staging is disabled")
        if self._staged in self._region_of:
            problems.append(f"staged model {self._staged} is also resident")
        if self.staging_in_progress is not None and self.staging_in_progress not in self._host:
            problems.append(f"{self.staging_in_progress} is being staged without a host copy")
        if unknown := sorted((self._host | set(self._region_of)) - self._specs.keys()):
            problems.append(f"unknown models in the tables: {unknown}")
        elif self.host_bytes_used > self.host_weight_bytes:
            problems.append(f"host copies use {self.host_bytes_used} > {self.host_weight_bytes}")
        return problems
