"""Frozen, validated configuration: models, instances, policies, clusters.

Every class validates on construction and raises :class:`~talaria.errors.ConfigError` with a
message that names the field and says what is expected. Units are in the field names or the
docstrings: bytes, tokens, seconds.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs

from talaria import validators as valid
from talaria.errors import ConfigError, UnknownModel

GB = 10**9
GiB = 2**30


_E = TypeVar("_E", bound=enum.Enum)


def _to_enum(kind: type[_E], name: str, value: object) -> _E:
    """A member of ``kind`` from a member or its value (a TOML config or a tuned knob
    writes ``slot_order = "round-robin"``); anything else raises ``ConfigError`` listing
    the values."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    allowed = ", ".join(repr(m.value) for m in kind)
    raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _model_tuple(values: Iterable[ModelSpec]) -> tuple[ModelSpec, ...]:
    return tuple(values)


def _instance_tuple(values: Iterable[InstanceSpec]) -> tuple[InstanceSpec, ...]:
    return tuple(values)


@attrs.frozen
class ModelSpec:
    """Shape of one served model, enough to size weights and KV and to cost compute.

    ``total_params`` sizes the weights; ``active_params`` (per token, MoE-aware) sizes the
    matrix work. ``dtype_bytes`` is bytes per weight parameter (2 for bf16, 1 for fp8);
    ``kv_dtype_bytes`` is bytes per KV element.
    """

    name: str = attrs.field(validator=valid.name)
    n_layers: int = attrs.field(validator=valid.positive_int)
    hidden_size: int = attrs.field(validator=valid.positive_int)
    n_heads: int = attrs.field(validator=valid.positive_int)
    n_kv_heads: int = attrs.field(validator=valid.positive_int)
    head_dim: int = attrs.field(validator=valid.positive_int)
    vocab_size: int = attrs.field(validator=valid.positive_int)
    total_params: int = attrs.field(validator=valid.positive_int)
    active_params: int = attrs.field(validator=valid.positive_int)
    dtype_bytes: float = attrs.field(default=2.0, validator=valid.positive)
    kv_dtype_bytes: int = attrs.field(default=2, validator=valid.positive_int)
    max_context: int = attrs.field(default=131072, validator=valid.positive_int)
    source: str = ""

    @classmethod
    def of_shape(cls, shape: object, name: str, **rest: Any) -> ModelSpec:
        """The spec named ``name`` with the architecture fields (:data:`SHAPE_FIELDS`) read
        from ``shape`` (a ``config.json`` shape, an engine architecture) and the rest
        (parameter counts, dtypes, source) given."""
        return cls(name=name, **{f: getattr(shape, f) for f in SHAPE_FIELDS}, **rest)

    def __attrs_post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model {self.name}: n_heads ({self.n_heads}) must be a multiple of "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.active_params > self.total_params:
            raise ConfigError(
                f"model {self.name}: active_params ({self.active_params}) exceeds "
                f"total_params ({self.total_params})"
            )

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in the serving dtype."""
        return int(self.total_params * self.dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.kv_dtype_bytes

    def kv_bytes_per_token_on(self, n_devices: int) -> int:
        """KV bytes per token on a tensor-parallel group of ``n_devices``: when the group is
        wider than the KV heads, each head is replicated (as vLLM does)."""
        return self.kv_bytes_per_token * max(1, n_devices // self.n_kv_heads)

    @property
    def flops_per_token(self) -> float:
        """Matrix FLOPs per token, excluding attention over the context (2 per active param)."""
        return 2.0 * self.active_params

    def attention_flops(self, context_tokens: float) -> float:
        """Attention FLOPs for one query token attending ``context_tokens`` keys (QK and AV)."""
        return 4.0 * self.n_layers * self.n_heads * self.head_dim * context_tokens


def find_model(models: Sequence[ModelSpec], name: str, listed_as: str) -> ModelSpec:
    """The model called ``name`` among ``models``; ``UnknownModel`` listing them (after
    ``listed_as``, e.g. "served models:") otherwise."""
    for m in models:
        if m.name == name:
            return m
    raise UnknownModel(f"unknown model {name!r}; {listed_as} {[m.name for m in models]}")


# The fields a model's architecture fixes, read by :meth:`ModelSpec.of_shape`.
SHAPE_FIELDS: Final = (
    "n_layers",
    "hidden_size",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "vocab_size",
    "max_context",
)


@attrs.frozen
class InstanceSpec:
    """One serving unit: a GPU, a tensor-parallel group, or on CPU a memory budget.

    ``device_memory_bytes`` and ``host_memory_bytes`` are totals over the instance's devices.
    ``memory_utilization`` is the share of device memory Talaria may use (the rest is left for
    activations, workspaces and the runtime). ``block_size`` is the KV block size in tokens of
    the model with the largest KV per token; a block has the same bytes for every model, so
    models with smaller KV per token fit more tokens in a block. ``weight_regions`` is how
    many models' weights device memory holds at once (each region the size of the largest
    model's weights, taken from the KV pool): with more than one, a model switched away stays
    resident in its region and switching back to it copies nothing; with one region per
    model, no switch after the first copies anything (engines that keep every model loaded,
    such as vLLM without sleep mode, are one region per model).
    """

    name: str = attrs.field(validator=valid.name)
    hardware: str = attrs.field(validator=valid.name)
    device_memory_bytes: int = attrs.field(validator=valid.positive_int)
    host_memory_bytes: int = attrs.field(validator=valid.non_negative)
    block_size: int = attrs.field(default=16, validator=valid.positive_int)
    n_devices: int = attrs.field(default=1, validator=valid.positive_int)
    memory_utilization: float = attrs.field(default=0.9, validator=valid.fraction)
    models: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    # The most of host memory kept for host copies of weights when not every model's fit
    # (the rest is the host KV tier); when they all fit in this share, all are kept.
    host_weight_share: float = attrs.field(default=0.65, validator=valid.fraction)
    weight_regions: int = attrs.field(default=1, validator=valid.positive_int)

    @property
    def usable_device_bytes(self) -> int:
        return int(self.device_memory_bytes * self.memory_utilization)


class Routing(enum.Enum):
    """How the router ranks instances for a call."""

    EXPECTED_COMPLETION = "expected-completion"  # Talaria: min expected seconds to finish
    LEAST_LOADED = "least-loaded"  # fewest queued+running tokens, per request
    STICKY = "sticky"  # the instance that served the session last, else least loaded
    CACHE_AFFINITY = "cache-affinity"  # longest device prefix match unless over a load cap
    STARTUP_TIME = "startup-time"  # ServerlessLLM: least time until the call can start (its
    # model loaded from the tier it is in, the slot and the queue ahead), per request
    CONCURRENCY_TARGET = "concurrency-target"  # a serverless autoscaler: a model gets an
    # instance per ``concurrency_target`` calls in flight, each instance one model's while it
    # has calls; the least-loaded of the model's instances, per request


class SlotOrder(enum.Enum):
    """Which model's slot opens next on a time-sliced instance, and when it closes."""

    ROUND_ROBIN = "round-robin"  # every model with work in turn, a quantum each (slot_max_s)
    OLDEST_WAITING = "oldest-waiting"  # the model of the oldest waiting call (a serverless,
    # per-request queue: FCFS across models), a quantum each
    SHORTEST_REMAINING = "shortest-remaining"  # Talaria: the model whose sessions have the
    # least expected remaining work per session, kept while they return, with a starvation bound


class QueueOrder(enum.Enum):
    """The order of a model's waiting calls on an instance."""

    FCFS = "fcfs"  # by arrival of the call (per request)
    PROGRAM_FCFS = "program-fcfs"  # Continuum: by the arrival of the call's session (program),
    # sessions holding a KV pin first


class Eviction(enum.Enum):
    """How KV victims are chosen when device blocks run short."""

    VALUE = "value"  # expected reuse soon (reservations, return probability), then recency
    LRU = "lru"  # least recently used


def _routing(value: object) -> Routing:
    return _to_enum(Routing, "routing", value)


def _eviction(value: object) -> Eviction:
    return _to_enum(Eviction, "eviction", value)


def _slot_order(value: object) -> SlotOrder:
    return _to_enum(SlotOrder, "slot_order", value)


def _queue_order(value: object) -> QueueOrder:
    return _to_enum(QueueOrder, "queue_order", value)


@attrs.frozen
class PolicyConfig:
    """Every knob of the mechanisms. Baselines are instances of this class (``baselines.py``).

    Times are seconds. ``slot_max_s`` bounds a slot while other models have work waiting;
    ``slot_linger_s`` keeps an idle slot open while a session of its model is expected back
    within that time; ``reservation_horizon_s`` is the window in which a return counts.

    ``slot_order`` picks the slot policy (``SlotOrder``). With ``SHORTEST_REMAINING`` the
    quantum and linger knobs give way to three of its own: ``slot_starvation_s``, the longest a
    waiting call may wait before its model's slot opens next (default 300 s: half the OpenAI
    client's default 600 s timeout, so a starved call is still answered before a default client
    gives up; infinity: no bound); ``slot_preempt_ratio``, how many times more remaining work
    per session the open slot's model must have than a waiting model's (its switch included)
    before the slot gives way to it (2: a
    switch is only worth it for a clear win, the break-even rule of ski rental); and the switch
    cost itself, which bounds how long an idle slot waits for its sessions' returns (linger
    while the soonest return is expected within a switch away and back).

    ``keep_alive_s`` is how long an instance with no call to serve stays provisioned before it
    scales to zero (its devices are given back: the weights leave the device, its KV is demoted to
    the host tier, and the next call there pays a load from host or disk). A reservation keeps it
    provisioned until the reservation ends (``talaria.policy.keep_alive``). Infinity (the default):
    instances never scale to zero. ``wake_shared``: the router charges a call that would wake an
    instance at zero only its share of the wait for the devices, the wait over the session's
    expected calls left (the session keeps the instance; ``talaria.policy.router``); off, each call
    is charged the whole wait, as a per-request router sees it. ``wake_charge_s``: what the router
    adds to the charge of a call that would wake an instance at zero, the devices' price in seconds
    of latency (0: latency alone decides; higher: fewer wakes, calls share the instances already
    up). ``pack_slack``: a call whose model has calls in flight on some instance goes to the
    cheapest of those whose charge is within ``1 + pack_slack`` times the least charge (it joins its
    model's batch there instead of starting the model on another instance; 0: the least charge).
    ``concurrency_target``: with ``Routing.CONCURRENCY_TARGET``, the calls in flight (queued or
    running) per instance of a model above which the model scales out to another instance
    (``talaria.policy.router``).
    """

    name: str = attrs.field(validator=valid.name)
    routing: Routing = attrs.field(default=Routing.EXPECTED_COMPLETION, converter=_routing)
    session_prefill: bool = True
    host_kv: bool = True
    weight_staging: bool = True
    soft_reservations: bool = True
    eviction: Eviction = attrs.field(default=Eviction.VALUE, converter=_eviction)
    kv_pin_ttl_s: float = attrs.field(default=0.0, validator=valid.non_negative)
    reservation_horizon_s: float = attrs.field(default=2.0, validator=valid.positive)
    reservation_min_probability: float = attrs.field(default=0.05, validator=valid.fraction)
    reservation_max_hold_s: float = attrs.field(default=60.0, validator=valid.positive)
    reclaim_after_wait_s: float = attrs.field(default=0.5, validator=valid.non_negative)
    slot_max_s: float = attrs.field(default=30.0, validator=valid.positive)
    slot_linger_s: float = attrs.field(default=2.0, validator=valid.non_negative)
    slot_order: SlotOrder = attrs.field(default=SlotOrder.ROUND_ROBIN, converter=_slot_order)
    queue_order: QueueOrder = attrs.field(default=QueueOrder.FCFS, converter=_queue_order)
    continuum_ttl: bool = False  # TTL pins sized per call by Continuum's rule, not kv_pin_ttl_s
    slot_starvation_s: float = attrs.field(default=300.0, validator=valid.positive_or_infinite)
    slot_preempt_ratio: float = attrs.field(default=2.0, validator=valid.positive)
    keep_alive_s: float = attrs.field(default=math.inf, validator=valid.non_negative_or_infinite)
    wake_shared: bool = True
    wake_charge_s: float = attrs.field(default=0.0, validator=valid.non_negative)
    pack_slack: float = attrs.field(default=0.0, validator=valid.non_negative)
    max_batch_tokens: int = attrs.field(default=8192, validator=valid.positive_int)
    max_running: int = attrs.field(default=256, validator=valid.positive_int)
    cache_affinity_load_cap: float = attrs.field(default=2.0, validator=valid.positive)
    cache_affinity_abs_tokens: int = attrs.field(default=8192, validator=valid.positive_int)
    concurrency_target: int = attrs.field(default=2, validator=valid.positive_int)
    admission_budget_fraction: float = attrs.field(default=1.0, validator=valid.fraction)
    # What the router assumes one queued or running call of a model still costs when it
    # estimates how long that model's slot will hold the device (the slot wait of a call of
    # another model): this many answer tokens at the batch's decode step plus a prefill of
    # this many tokens, capped by slot_max_s per model.
    slot_wait_output_tokens: int = attrs.field(default=100, validator=valid.positive_int)
    slot_wait_prefill_tokens: int = attrs.field(default=2048, validator=valid.positive_int)
    # Weight staging borrows free device KV blocks: this share of the KV pool stays free for
    # calls that arrive while a stage runs, and a partial stage smaller than this share of
    # the model's weights is not worth starting (it saves less than it costs to track).
    stage_headroom: float = attrs.field(default=0.05, validator=valid.fraction)
    stage_min_share: float = attrs.field(default=0.1, validator=valid.fraction)

    def __attrs_post_init__(self) -> None:
        if self.slot_preempt_ratio < 1.0:
            raise ConfigError(
                f"slot_preempt_ratio must be >= 1 (1: preempt on any win), "
                f"got {self.slot_preempt_ratio!r}"
            )


@attrs.frozen
class ClusterConfig:
    """Models and the instances that serve them. Each model must fit on some instance."""

    models: tuple[ModelSpec, ...] = attrs.field(converter=_model_tuple)
    instances: tuple[InstanceSpec, ...] = attrs.field(converter=_instance_tuple)

    def __attrs_post_init__(self) -> None:
        if not self.models:
            raise ConfigError("a cluster needs at least one model")
        if not self.instances:
            raise ConfigError("a cluster needs at least one instance")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError(f"model names must be unique, got {names}")
        inames = [i.name for i in self.instances]
        if len(set(inames)) != len(inames):
            raise ConfigError(f"instance names must be unique, got {inames}")
        known = set(names)
        for inst in self.instances:
            unknown = set(inst.models) - known
            if unknown:
                raise ConfigError(f"instance {inst.name} lists unknown models {sorted(unknown)}")
        for model in self.models:
            hosts = self.instances_for(model.name)
            if not hosts:
                raise ConfigError(f"no instance is configured to serve model {model.name}")
            if not any(model.weight_bytes < i.usable_device_bytes for i in hosts):
                best = max(i.usable_device_bytes for i in hosts)
                raise ConfigError(
                    f"model {model.name} needs {model.weight_bytes / GB:.1f} GB of weights but "
                    f"the largest instance that may serve it has {best / GB:.1f} GB usable; "
                    "use a larger tensor-parallel group or a smaller dtype"
                )
        for inst in self.instances:
            arena = inst.weight_regions * max(m.weight_bytes for m in self.models_on(inst))
            if inst.weight_regions > 1 and arena >= inst.usable_device_bytes:
                raise ConfigError(
                    f"instance {inst.name}: {inst.weight_regions} weight regions of the largest "
                    f"model it serves take {arena / GB:.1f} GB of its "
                    f"{inst.usable_device_bytes / GB:.1f} GB usable, leaving none for KV; "
                    "use fewer weight_regions"
                )

    def model(self, name: str) -> ModelSpec:
        return find_model(self.models, name, "served models:")

    def instances_for(self, model: str) -> tuple[InstanceSpec, ...]:
        """Instances allowed to serve ``model`` (an instance with no model list serves all)."""
        return tuple(i for i in self.instances if not i.models or model in i.models)

    def models_on(self, instance: InstanceSpec) -> tuple[ModelSpec, ...]:
        return tuple(m for m in self.models if not instance.models or m.name in instance.models)


CACHE_ENV: Final = "TALARIA_CACHE_DIR"


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where Talaria keeps what it builds or measures on a machine (the native decode kernel,
    the ``cpu`` profile's calibration): ``$TALARIA_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/talaria``, else ``~/.cache/talaria``."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "talaria"
    return Path.home() / ".cache" / "talaria"
