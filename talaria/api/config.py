"""``TalariaConfig``: what ``talaria.api.Talaria`` serves and how, and its TOML form.

Validated on construction (a ``ConfigError`` naming the field); no I/O except
:meth:`TalariaConfig.from_toml`. It turns into the lower-level configs the runtime takes
(``talaria.config.PolicyConfig``, ``InstanceSpec``); tenant names are checked against
``talaria.types.DEFAULT_TENANT``.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from talaria.api.answer_script import AnswerScript, answer_script
from talaria.api.tool_parsers import ToolFormat
from talaria.config import InstanceSpec, PolicyConfig
from talaria.engine.catalog import DEFAULT_MODELS, ENTRIES
from talaria.errors import ConfigError
from talaria.policy.baselines import policy as named_policy
from talaria.runtime.live import DEFAULT_MAX_CALLS
from talaria.types import DEFAULT_TENANT

GB = 10**9
DEFAULT_MAX_TOKENS = 1024
BACKENDS = ("embedded", "vllm")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _models(value: Any) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names:
        raise ConfigError("serve at least one model (models = [...])")
    if len(set(names)) != len(names):
        raise ConfigError(f"models are listed twice: {list(names)}")
    return names


def _positive(_: Any, attribute: Any, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{attribute.name} must be positive, got {value!r}")


def _non_negative(_: Any, attribute: Any, value: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    if not ok or value != value or value == float("inf"):
        raise ConfigError(f"{attribute.name} must be a finite number of 0 or more, got {value!r}")


@attrs.frozen
class TalariaConfig:
    """What ``Talaria`` serves and how. Units: bytes, seconds.

    The default serves SmolLM2-135M (real weights) and two published configurations with
    random weights (Qwen2.5-0.5B, Llama-3.2-1B) on one CPU instance whose device budget
    (3 GB x 0.9) cannot hold their 3.73 GB of bfloat16 weights at once, so model switches,
    KV demotion to the host tier (6 GB with the weights) and weight staging are real (the
    embedded replay's instance). About 9 GB of RAM in all. ``policy`` names one of
    docs/design.md's policies; ``policy_overrides`` sets any of its knobs (for example
    ``{"slot_max_s": 4.0}``).
    """

    models: tuple[str, ...] = attrs.field(default=DEFAULT_MODELS, converter=_models)
    instances: int = attrs.field(default=1, validator=_positive)
    device_memory_bytes: int = attrs.field(default=3 * GB, validator=_positive)
    host_memory_bytes: int = attrs.field(default=6 * GB, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    memory_utilization: float = 0.9
    # models whose weights device memory holds at once (InstanceSpec.weight_regions): more
    # than one keeps switched-away models resident, at the cost of KV memory
    weight_regions: int = 1
    hardware: str = "cpu"
    device: str = "cpu"
    dtype: str = "bfloat16"
    policy: str = "talaria"
    policy_overrides: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    # API key -> tenant name (a TOML [tenants] table); a key listed here is accepted too.
    # Any other configured key is a tenant of its own (named by a digest of the key).
    tenants: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    # calls in flight (queued or running) the server takes at most; past it a call gets
    # 429 with Retry-After instead of waiting without bound
    max_calls: int = DEFAULT_MAX_CALLS
    # the most of them one tenant may hold (None: max_calls), so that one tenant's overload
    # leaves the others room
    max_calls_per_tenant: int | None = None
    # tokens (prompt plus max_tokens) one tenant's calls may ask for per minute (None: no
    # limit); past it a call gets 429 with the seconds until the budget refills
    tokens_per_minute_per_tenant: int | None = None
    # sessions one tenant may have open at once (None: no limit); a call that would open
    # another gets 429 until one ends (an end event, or session_idle_s without a call)
    max_sessions_per_tenant: int | None = None
    session_idle_s: float = attrs.field(default=600.0, validator=_positive)
    shutdown_grace_s: float = attrs.field(default=30.0, validator=_positive)
    default_max_tokens: int = attrs.field(default=DEFAULT_MAX_TOKENS, validator=_positive)
    # a max_tokens that the prompt leaves no room for: false (the default) answers with
    # what the context leaves (ChatResult / ChatChunk.max_tokens_clamped says how many);
    # true refuses the call with ContextTooLong, as OpenAI does
    strict_max_tokens: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    # model -> how it writes tool calls (a talaria.api.tool_parsers.ToolFormat value, a TOML
    # [tool_parsers] table); a model not listed gets the format its chat template teaches
    tool_parsers: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    # protocol tests of agent clients on random-weight models: every answer decoded under
    # the script's grammars (talaria.api.answer_script; a TOML [answer_script] table with
    # text and tool_calls); None, the default: answers are the model's own
    answer_script: AnswerScript | None = attrs.field(default=None, converter=answer_script)
    # which engine executes: "embedded" (Talaria's PyTorch engine, the catalog's models) or
    # "vllm" (one vLLM engine per model; models name [vllm_models.NAME] tables, see
    # talaria.backends.vllm.catalog)
    backend: str = "embedded"
    vllm_models: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    config_dir: Path | None = None  # where the TOML file was (relative vLLM model paths)
    # run each instance in a Ray actor (talaria.backends.ray): "auto", "HOST:PORT",
    # "ray://HOST:PORT" or "local" (a private one-node Ray); None: every instance in process.
    # The embedded engine's instances, or with backend "vllm" `instances` instances each
    # running one vLLM engine per model (the actors' nodes hold the model directories)
    ray: str | None = None
    # the custom resource each instance's actor takes one unit of (one per node: `ray start
    # --resources '{"talaria_instance": 1}'`), and the CPUs it reserves (its torch threads)
    ray_resource: str = "talaria_instance"
    ray_cpus: float = attrs.field(default=1.0, validator=_positive)
    # the GPUs each instance's actor reserves: the embedded engine takes the instance's
    # devices on CUDA; vLLM's engines take this many (0: the engines run on CPU)
    ray_gpus: float = attrs.field(default=0.0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        w = self.weight_regions
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ConfigError(f"weight_regions must be a positive integer, got {w!r}")
        if w != 1 and self.backend != "embedded":
            raise ConfigError(
                "weight_regions is the embedded engine's: the vLLM backend keeps one region "
                "per model without sleep mode and one awake model with it (drop weight_regions)"
            )
        if self.backend == "embedded":
            for n in self.models:
                if n not in ENTRIES:
                    raise ConfigError(f"unknown model {n!r}; the catalog has {sorted(ENTRIES)}")
        else:
            self.vllm_catalog()  # every model has a valid table
        if self.ray is not None:
            if not isinstance(self.ray, str) or not self.ray.strip():
                raise ConfigError(f"ray must be an address, 'auto' or 'local', got {self.ray!r}")
            if not isinstance(self.ray_resource, str) or not self.ray_resource.strip():
                raise ConfigError(
                    f"ray_resource must be a resource name, got {self.ray_resource!r}"
                )
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        per_tenant = ("max_calls_per_tenant", "tokens_per_minute_per_tenant")
        for knob in ("max_calls", *per_tenant, "max_sessions_per_tenant"):
            v = getattr(self, knob)
            if v is None and knob != "max_calls":  # the per-tenant limits may be off
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{knob} must be a positive integer, got {v!r}")
        for key, name in self.tenants.items():
            ok = isinstance(name, str) and 0 < len(name) <= 64 and name.isprintable()
            if not isinstance(key, str) or not key.strip() or not ok or name == DEFAULT_TENANT:
                raise ConfigError(
                    f"tenants maps API keys to tenant names of 1 to 64 printable characters "
                    f"(not {DEFAULT_TENANT!r}); got {name!r}"
                )
        formats = sorted(f.value for f in ToolFormat)
        for model, fmt in self.tool_parsers.items():
            if model not in self.models or fmt not in formats:
                raise ConfigError(
                    f"tool_parsers maps served models ({', '.join(self.models)}) to one of "
                    f"{formats}; got {model!r} = {fmt!r}"
                )
        self.policy_config()  # unknown policy or knob

    @classmethod
    def default(cls) -> TalariaConfig:
        return cls()

    @classmethod
    def from_toml(cls, path: str | Path) -> TalariaConfig:
        """Read a TOML file: top-level keys are this class's fields; a ``[policy]`` table
        holds ``name`` and any knob of the policy."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {p} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc
        policy = data.pop("policy", None)
        if isinstance(policy, dict):
            data["policy"] = policy.pop("name", "talaria")
            data["policy_overrides"] = policy
        elif policy is not None:
            data["policy"] = policy
        if data.get("backend") == "vllm" and "models" not in data:
            tables = data.get("vllm_models")
            if isinstance(tables, dict) and tables:  # serve every model the tables name
                data["models"] = list(tables)
        known = {f.name for f in attrs.fields(cls)} - {"config_dir"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"config file {p}: unknown keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**data, config_dir=p.resolve().parent)
        except TypeError as exc:
            raise ConfigError(f"config file {p}: {exc}") from exc

    def policy_config(self) -> PolicyConfig:
        base = named_policy(self.policy)
        known = {f.name for f in attrs.fields(PolicyConfig)} - {"name"}
        unknown = sorted(set(self.policy_overrides) - known)
        if unknown:
            raise ConfigError(f"unknown policy knobs {unknown}; known: {sorted(known)}")
        return attrs.evolve(base, **self.policy_overrides)

    def vllm_catalog(self) -> tuple[Any, ...]:
        """The served models as ``talaria.backends.vllm.catalog.VllmModel`` entries (reads
        nothing; ConfigError for a missing or malformed table)."""
        from talaria.backends.vllm.catalog import catalog_from_tables

        return catalog_from_tables(self.vllm_models, self.models, self.config_dir)

    def instance_specs(self) -> tuple[InstanceSpec, ...]:
        return tuple(
            InstanceSpec(
                name=f"{self.hardware}-{i}",
                hardware=self.hardware,
                device_memory_bytes=self.device_memory_bytes,
                host_memory_bytes=self.host_memory_bytes,
                block_size=self.block_size,
                memory_utilization=self.memory_utilization,
                weight_regions=self.weight_regions,
            )
            for i in range(self.instances)
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
