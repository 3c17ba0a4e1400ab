"""The shape of a Llama-family model (Llama, Qwen2), read from a Hugging Face config.

:class:`ModelArch` is the validated shape of a model (read from a Hugging Face ``config.json``
by :meth:`ModelArch.from_hf_config`); it names every parameter with its Hugging Face name and
shape (:meth:`ModelArch.param_shapes`), sizes weights and KV, and gives the rotary inverse
frequencies of its :class:`RopeScaling` (:meth:`ModelArch.rope_inv_freq`). Everything else in
the engine is sized from it: :mod:`talaria.engine.weight_layout` binds its parameters,
:mod:`talaria.engine.kv_pool` its KV, and :class:`~talaria.engine.model.LlamaModel` runs it.

Rotary conventions follow Hugging Face transformers: float32 frequencies, with the scaling
variants of ``rope_type`` (linear, dynamic NTK, llama3, yarn).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

import attrs
import torch

from talaria import validators as valid
from talaria.config import ModelSpec
from talaria.errors import ConfigError

_HF_ARCHITECTURES: Final = MappingProxyType(
    {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
)


class Arch(enum.Enum):
    """Supported model families (the Hugging Face ``model_type``)."""

    LLAMA = "llama"
    QWEN2 = "qwen2"


class RopeKind(enum.Enum):
    """Rotary scaling variants, named as in Hugging Face ``rope_type``."""

    LINEAR = "linear"
    DYNAMIC = "dynamic"
    LLAMA3 = "llama3"
    YARN = "yarn"


# ----------------------------------------------------------------------------- validators


def _is_bool(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attr.name} must be True or False, got {value!r}")


def _is(kind: type) -> Any:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, kind):
            raise ConfigError(f"{attr.name} must be a {kind.__name__}, got {value!r}")

    return check


def element_size(dtype: torch.dtype) -> int:
    """Bytes of one element of the floating ``dtype``; ``ConfigError`` for any other."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------- rotary


@attrs.frozen
class RopeScaling:
    """Rotary scaling parameters (Hugging Face ``rope_parameters`` / ``rope_scaling``).

    ``factor`` is the context stretch (all kinds). ``original_max_position_embeddings`` is the
    pre-training context in tokens (llama3 and yarn). ``low_freq_factor`` and
    ``high_freq_factor`` shape llama3's smooth band. ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim``, ``attention_factor`` and ``truncate`` are yarn's, with transformers'
    defaults (``attention_factor`` None: derived from ``factor`` and the mscales).
    """

    kind: RopeKind = attrs.field(validator=_is(RopeKind))
    factor: float = attrs.field(validator=valid.positive)
    original_max_position_embeddings: int | None = attrs.field(
        default=None, validator=valid.optional_positive_int
    )
    low_freq_factor: float = attrs.field(default=1.0, validator=valid.positive)
    high_freq_factor: float = attrs.field(default=4.0, validator=valid.positive)
    beta_fast: float = attrs.field(default=32.0, validator=valid.positive)
    beta_slow: float = attrs.field(default=1.0, validator=valid.positive)
    mscale: float | None = attrs.field(default=None, validator=valid.optional_positive)
    mscale_all_dim: float | None = attrs.field(default=None, validator=valid.optional_positive)
    attention_factor: float | None = attrs.field(default=None, validator=valid.optional_positive)
    truncate: bool = attrs.field(default=True, validator=_is_bool)

    def __attrs_post_init__(self) -> None:
        needs_original = self.kind in (RopeKind.LLAMA3, RopeKind.YARN)
        if needs_original and self.original_max_position_embeddings is None:
            raise ConfigError(
                f"rope_scaling.original_max_position_embeddings is required for {self.kind.value}"
            )
        if self.kind is RopeKind.LLAMA3 and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """Unscaled inverse frequencies, float32 ``[dim // 2]`` (radians per position)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, rs: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, a smooth band between."""
    old_len = float(rs.original_max_position_embeddings or 0)
    low_wavelen = old_len / rs.low_freq_factor
    high_wavelen = old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(theta: float, dim: int, rs: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    factor = rs.factor
    attn = rs.attention_factor
    if attn is None:
        if rs.mscale and rs.mscale_all_dim:
            attn = _yarn_mscale(factor, rs.mscale) / _yarn_mscale(factor, rs.mscale_all_dim)
        else:
            attn = _yarn_mscale(factor)
    original = float(rs.original_max_position_embeddings or 0)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attn)


# ----------------------------------------------------------------------------- architecture


@attrs.frozen
class ModelArch:
    """Validated shape of a Llama-family model. Sizes in elements, context in tokens.

    ``attention_bias``: the q/k/v projections have a bias (always for Qwen2); for Llama the
    output projection has one too, as in transformers (``output_bias``).
    """

    architecture: Arch = attrs.field(validator=_is(Arch))
    vocab_size: int = attrs.field(validator=valid.positive_int)
    hidden_size: int = attrs.field(validator=valid.positive_int)
    intermediate_size: int = attrs.field(validator=valid.positive_int)
    n_layers: int = attrs.field(validator=valid.positive_int)
    n_heads: int = attrs.field(validator=valid.positive_int)
    n_kv_heads: int = attrs.field(validator=valid.positive_int)
    head_dim: int = attrs.field(validator=valid.positive_int)
    rms_norm_eps: float = attrs.field(default=1e-6, validator=valid.positive)
    rope_theta: float = attrs.field(default=10000.0, validator=valid.positive)
    rope_scaling: RopeScaling | None = attrs.field(default=None)
    max_position_embeddings: int = attrs.field(default=2048, validator=valid.positive_int)
    tie_word_embeddings: bool = attrs.field(default=False, validator=_is_bool)
    attention_bias: bool = attrs.field(default=False, validator=_is_bool)

    def __attrs_post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(
                f"rope_scaling must be None or a RopeScaling, got {self.rope_scaling}"
            )
        if self.architecture is Arch.QWEN2 and not self.attention_bias:
            raise ConfigError("attention_bias must be True for qwen2 (q/k/v projections)")

    @property
    def output_bias(self) -> bool:
        """Whether ``o_proj`` has a bias (Llama with ``attention_bias``; never Qwen2)."""
        return self.attention_bias and self.architecture is Arch.LLAMA

    @property
    def max_context(self) -> int:
        """Longest sequence in tokens: ``max_position_embeddings`` (times ``factor`` for
        dynamic NTK, whose ``max_position_embeddings`` is the pre-training length)."""
        rs = self.rope_scaling
        if rs is not None and rs.kind is RopeKind.DYNAMIC:
            return int(self.max_position_embeddings * rs.factor)
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelArch:
        """Read a Hugging Face ``config.json`` dict of a LlamaForCausalLM or Qwen2ForCausalLM.

        Raises ``ConfigError`` naming the config field for an unsupported architecture or
        feature (sliding window, MLP bias, activation other than silu, unknown rope type) and
        for missing or invalid values.
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"a model config must be a mapping, got {type(config).__name__}")
        arch = _hf_architecture(config)
        _reject_unsupported(config)
        hidden = _hf_int(config, "hidden_size")
        heads = _hf_int(config, "num_attention_heads")
        head_dim = config.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(
                    f"config field 'head_dim' is missing and hidden_size ({hidden}) is not a "
                    f"multiple of num_attention_heads ({heads})"
                )
            head_dim = hidden // heads
        theta, scaling = _hf_rope(config)
        return cls(
            architecture=arch,
            vocab_size=_hf_int(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_hf_int(config, "intermediate_size"),
            n_layers=_hf_int(config, "num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=_hf_int(config, "num_key_value_heads", heads),
            head_dim=_hf_int({"head_dim": head_dim}, "head_dim"),
            rms_norm_eps=_hf_float(config, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_hf_int(
                config, "max_position_embeddings", 32768 if arch is Arch.QWEN2 else 2048
            ),
            tie_word_embeddings=_hf_bool(config, "tie_word_embeddings", False),
            attention_bias=arch is Arch.QWEN2 or _hf_bool(config, "attention_bias", False),
        )

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's Hugging Face name and shape, in the fixed binding order.

        Per layer the q, k, v weights are adjacent, then their biases, and the gate and up
        weights are adjacent, so :class:`~talaria.engine.model.LlamaModel` can run each group
        as one matmul.
        """
        h, hd = self.hidden_size, self.head_dim
        q_rows, kv_rows = self.n_heads * hd, self.n_kv_heads * hd
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, h)
            if self.attention_bias:
                for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                    shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
            if self.output_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    @property
    def n_params(self) -> int:
        """Number of parameters (elements), tied embeddings counted once."""
        return sum(math.prod(shape) for shape in self.param_shapes().values())

    def weight_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of all weights in ``dtype``: exactly what
        :func:`~talaria.engine.weight_layout.bind_weights` needs."""
        return self.n_params * element_size(dtype)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers, elements of ``dtype``."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * element_size(dtype)

    def to_spec(
        self,
        name: str,
        dtype: torch.dtype = torch.bfloat16,
        kv_dtype: torch.dtype | None = None,
        source: str = "",
    ) -> ModelSpec:
        """The policy's :class:`ModelSpec` of this model served in ``dtype`` (KV in
        ``kv_dtype``, default ``dtype``). Active parameters are those in matrix products:
        all but an untied input embedding (a lookup)."""
        total = self.n_params
        lookup = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return ModelSpec.of_shape(
            self,
            name,
            total_params=total,
            active_params=total - lookup,
            dtype_bytes=float(element_size(dtype)),
            kv_dtype_bytes=element_size(kv_dtype or dtype),
            source=source,
        )

    def rope_inv_freq(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """Inverse frequencies (float32 ``[head_dim // 2]``, CPU) and the cos/sin scale.

        ``seq_len`` (tokens) matters only for dynamic NTK, which stretches the base once a
        sequence is longer than ``max_position_embeddings``.
        """
        dim, theta, rs = self.head_dim, float(self.rope_theta), self.rope_scaling
        if rs is None:
            return _base_inv_freq(theta, dim), 1.0
        if rs.kind is RopeKind.LINEAR:
            return _base_inv_freq(theta, dim) / rs.factor, 1.0
        if rs.kind is RopeKind.LLAMA3:
            return _llama3_inv_freq(_base_inv_freq(theta, dim), rs), 1.0
        if rs.kind is RopeKind.YARN:
            return _yarn_inv_freq(theta, dim, rs)
        length = max(seq_len or 0, self.max_position_embeddings)
        stretch = rs.factor * length / self.max_position_embeddings - (rs.factor - 1)
        return _base_inv_freq(theta * stretch ** (dim / (dim - 2)), dim), 1.0


# ----------------------------------------------------------------------------- HF config


def _hf_architecture(config: Mapping[str, Any]) -> Arch:
    names = config.get("architectures")
    if names is None:
        model_type = config.get("model_type")
        if model_type in {a.value for a in Arch}:
            return Arch(str(model_type))
        raise ConfigError(
            f"config field 'architectures' is missing and model_type {model_type!r} is not one "
            f"of {[a.value for a in Arch]}"
        )
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise ConfigError(f"config field 'architectures' must be a non-empty list, got {names!r}")
    if names[0] not in _HF_ARCHITECTURES:
        raise ConfigError(
            f"config field 'architectures' names {names[0]!r}, which is not supported; "
            f"supported: {sorted(_HF_ARCHITECTURES)}"
        )
    return Arch(_HF_ARCHITECTURES[names[0]])


def _reject_unsupported(config: Mapping[str, Any]) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config field 'hidden_act' is {act!r}; only 'silu' is supported")
    if config.get("mlp_bias"):
        raise ConfigError("config field 'mlp_bias' is true; MLP biases are not supported")
    if config.get("use_sliding_window"):
        raise ConfigError(
            "config field 'use_sliding_window' is true; sliding window attention is not supported"
        )
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            "config field 'partial_rotary_factor' must be 1.0 (partial rotary is not supported)"
        )


def _hf_int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ConfigError(f"config field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _hf_float(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"config field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _hf_bool(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"config field {key!r} must be true or false, got {value!r}")
    return value


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling`` fields."""
    field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = config.get(field) or {}
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        raise ConfigError(f"config field {field!r} must be one flat mapping, got {params!r}")
    if params.get("rope_theta") is not None:
        theta = _hf_float(params, "rope_theta", 10000.0)
    else:
        theta = _hf_float(config, "rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in {k.value for k in RopeKind}:
        raise ConfigError(
            f"config field '{field}.rope_type' is {kind!r}; supported: "
            f"{['default', *(k.value for k in RopeKind)]}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"config field '{field}.partial_rotary_factor' must be 1.0")
    return theta, _hf_rope_scaling(config, params, RopeKind(kind), field)


def _hf_rope_scaling(
    config: Mapping[str, Any], params: Mapping[str, Any], kind: RopeKind, field: str
) -> RopeScaling:
    """The scaling of ``kind`` from rope ``params``, with transformers' defaults."""
    extra: dict[str, Any] = {}
    if kind in (RopeKind.LLAMA3, RopeKind.YARN):
        max_pos = config.get("max_position_embeddings", 2048)
        extra["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings"
        ) or params.get("original_max_position_embeddings", max_pos)
    factor: Any = params.get("factor")
    if factor is None and kind is RopeKind.YARN:
        original = extra["original_max_position_embeddings"]
        if isinstance(original, int) and original > 0:
            factor = config.get("max_position_embeddings", 2048) / original
    required = ("low_freq_factor", "high_freq_factor") if kind is RopeKind.LLAMA3 else ()
    for key in ("factor", *required):
        if (factor if key == "factor" else params.get(key)) is None:
            raise ConfigError(f"config field '{field}.{key}' is required for {kind.value}")
        if key != "factor":
            extra[key] = params[key]
    if kind is RopeKind.YARN:
        extra.update(
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=params.get("truncate", True),
        )
    try:
        return RopeScaling(kind=kind, factor=factor, **extra)
    except ConfigError as exc:
        raise ConfigError(f"config field {field!r}: {exc}") from None
