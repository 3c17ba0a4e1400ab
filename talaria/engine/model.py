"""Llama-family forward pass (Llama, Qwen2) on a paged KV pool, in plain PyTorch.

Three pieces:

* :class:`ModelArch` is the validated shape of a model (read from a Hugging Face
  ``config.json`` by :meth:`ModelArch.from_hf_config`); it names every parameter with its
  Hugging Face name and shape (:meth:`ModelArch.param_shapes`) and sizes weights and KV.
* :func:`bind_weights` carves every parameter as a view of one flat, preallocated region, in a
  fixed order, so a model's parameters always sit at the same addresses. Loading a model is
  copying into these views; nothing is reallocated, so data pointers never change.
* :class:`LlamaModel` runs one step for a batch (:class:`BatchInput`) that mixes prefill chunks
  and decode steps: each sequence computes some tokens starting at the number of tokens its
  KV cache already holds. Projections and the MLP run over all tokens of all sequences at
  once; attention runs per sequence over its paged KV (decode steps are batched together).

Conventions follow Hugging Face transformers: RMSNorm computed in float32, rotary embeddings
in the "rotate_half" layout with float32 frequencies, SwiGLU MLP, grouped-query attention where
KV head ``j`` serves query heads ``j * g .. (j + 1) * g - 1``.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

import attrs
import torch
import torch.nn.functional as F

from talaria.config import ModelSpec
from talaria.engine.attention import PagedGroup, Scratch, attend_decode, attend_prefill
from talaria.engine.kernels import MAX_SMALL_M, DecodeKernel
from talaria.errors import BadRequest, ConfigError, ContextTooLong

if TYPE_CHECKING:
    from talaria.engine.kv_pool import PagedKV

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


def _pos_int(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attr.name} must be a positive integer, got {value!r}")


def _pos_float(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{attr.name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{attr.name} must be finite, got {value!r}")


def _opt_pos_float(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _pos_float(inst, attr, value)


def _opt_pos_int(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _pos_int(inst, attr, value)


def _is_bool(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attr.name} must be True or False, got {value!r}")


def _is(kind: type) -> Any:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, kind):
            raise ConfigError(f"{attr.name} must be a {kind.__name__}, got {value!r}")

    return check


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
    factor: float = attrs.field(validator=_pos_float)
    original_max_position_embeddings: int | None = attrs.field(default=None, validator=_opt_pos_int)
    low_freq_factor: float = attrs.field(default=1.0, validator=_pos_float)
    high_freq_factor: float = attrs.field(default=4.0, validator=_pos_float)
    beta_fast: float = attrs.field(default=32.0, validator=_pos_float)
    beta_slow: float = attrs.field(default=1.0, validator=_pos_float)
    mscale: float | None = attrs.field(default=None, validator=_opt_pos_float)
    mscale_all_dim: float | None = attrs.field(default=None, validator=_opt_pos_float)
    attention_factor: float | None = attrs.field(default=None, validator=_opt_pos_float)
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
    vocab_size: int = attrs.field(validator=_pos_int)
    hidden_size: int = attrs.field(validator=_pos_int)
    intermediate_size: int = attrs.field(validator=_pos_int)
    n_layers: int = attrs.field(validator=_pos_int)
    n_heads: int = attrs.field(validator=_pos_int)
    n_kv_heads: int = attrs.field(validator=_pos_int)
    head_dim: int = attrs.field(validator=_pos_int)
    rms_norm_eps: float = attrs.field(default=1e-6, validator=_pos_float)
    rope_theta: float = attrs.field(default=10000.0, validator=_pos_float)
    rope_scaling: RopeScaling | None = attrs.field(default=None)
    max_position_embeddings: int = attrs.field(default=2048, validator=_pos_int)
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
        weights are adjacent, so :class:`LlamaModel` can run each group as one matmul.
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
        """Bytes of all weights in ``dtype``: exactly what :func:`bind_weights` needs."""
        return self.n_params * _element_size(dtype)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers, elements of ``dtype``."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * _element_size(dtype)

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
        return ModelSpec(
            name=name,
            n_layers=self.n_layers,
            hidden_size=self.hidden_size,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            total_params=total,
            active_params=total - lookup,
            dtype_bytes=float(_element_size(dtype)),
            kv_dtype_bytes=_element_size(kv_dtype or dtype),
            max_context=self.max_context,
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


# ----------------------------------------------------------------------------- weights


def _element_size(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def _typed_flat(region: torch.Tensor, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of ``region`` as a flat ``dtype`` tensor sharing its storage."""
    if not isinstance(region, torch.Tensor) or region.dim() != 1 or not region.is_contiguous():
        raise ConfigError("region must be a 1-D contiguous tensor (uint8 bytes or the dtype)")
    size = _element_size(dtype)
    if region.dtype not in (torch.uint8, dtype):
        raise ConfigError(f"region must be uint8 or {dtype}, got {region.dtype}")
    have = region.numel() * region.element_size()
    if have < nbytes:
        raise ConfigError(f"region holds {have} bytes but the model's weights need {nbytes}")
    if region.dtype == dtype:
        return region[: nbytes // size]
    if region.storage_offset() % size:
        raise ConfigError(f"region's byte offset is not aligned to {size} bytes for {dtype}")
    return region[:nbytes].view(dtype)


def bind_weights(
    arch: ModelArch, region: torch.Tensor, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every parameter of ``arch`` as a view into ``region``, in :meth:`~ModelArch.param_shapes`
    order from byte 0, back to back.

    ``region`` is a 1-D contiguous tensor of bytes (uint8) or of ``dtype`` with at least
    ``arch.weight_bytes(dtype)`` bytes. Nothing is allocated or copied: binding the same model
    to the same region again gives views at the same addresses, and loading a model is
    ``view.copy_(tensor)``. Raises ``ConfigError`` if the region is too small or mistyped.
    """
    flat = _typed_flat(region, dtype, arch.weight_bytes(dtype))
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in arch.param_shapes().items():
        n = math.prod(shape)
        views[name] = flat[offset : offset + n].view(shape)
        offset += n
    return views


def _adjacent(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view stacking ``parts`` along dim 0 if they lie back to back in one storage, else
    None (never a copy: a copy would not follow weights loaded into the parts later)."""
    first = parts[0]
    offset = first.storage_offset()
    ptr = first.untyped_storage().data_ptr()
    for part in parts:
        if (
            not part.is_contiguous()
            or part.untyped_storage().data_ptr() != ptr
            or part.storage_offset() != offset
            or part.shape[1:] != first.shape[1:]
        ):
            return None
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


@attrs.frozen(eq=False)
class _Layer:
    """One decoder layer's weight views; fused views are None when parts are not adjacent."""

    in_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qkv: torch.Tensor | None
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    gate_up: torch.Tensor | None
    down: torch.Tensor


def _layer_views(weights: Mapping[str, torch.Tensor], arch: ModelArch, i: int) -> _Layer:
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    q, k, v = (weights[f"{attn}{n}_proj.weight"] for n in "qkv")
    biases = [weights.get(f"{attn}{n}_proj.bias") for n in "qkv"]
    fused_bias = None
    if biases[0] is not None and biases[1] is not None and biases[2] is not None:
        fused_bias = _adjacent([biases[0], biases[1], biases[2]])
    gate, up = weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]
    return _Layer(
        in_norm=weights[p + "input_layernorm.weight"],
        q=q,
        k=k,
        v=v,
        qkv=_adjacent([q, k, v]),
        q_bias=biases[0],
        k_bias=biases[1],
        v_bias=biases[2],
        qkv_bias=fused_bias,
        o=weights[attn + "o_proj.weight"],
        o_bias=weights.get(attn + "o_proj.bias"),
        post_norm=weights[p + "post_attention_layernorm.weight"],
        gate=gate,
        up=up,
        gate_up=_adjacent([gate, up]),
        down=weights[p + "mlp.down_proj.weight"],
    )


def _check_weights(arch: ModelArch, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Raise ``ConfigError`` unless ``weights`` has exactly ``arch``'s parameters with their
    shapes, one floating dtype and one device; returns the embedding."""
    shapes = arch.param_shapes()
    if missing := [n for n in shapes if n not in weights]:
        raise ConfigError(f"weights lack {len(missing)} parameters, first {missing[0]!r}")
    if extra := sorted(set(weights) - set(shapes)):
        raise ConfigError(f"weights have parameters the architecture lacks, first {extra[0]!r}")
    embed = weights["model.embed_tokens.weight"]
    for name, shape in shapes.items():
        w = weights[name]
        if tuple(w.shape) != shape:
            raise ConfigError(f"parameter {name!r} has shape {tuple(w.shape)}, expected {shape}")
        if w.dtype != embed.dtype or w.device != embed.device:
            raise ConfigError(f"parameter {name!r} is {w.dtype} on {w.device}, unlike the others")
    _element_size(embed.dtype)
    return embed


# ----------------------------------------------------------------------------- batch


def _ints(field: str, values: Iterable[int]) -> tuple[int, ...]:
    try:
        return tuple(operator.index(v) for v in values)
    except TypeError as exc:
        raise BadRequest(f"{field} must be a sequence of integers: {exc}") from None


def _token_ids(values: Iterable[int]) -> tuple[int, ...]:
    return _ints("token_ids", values)


def _block_table(values: Iterable[int]) -> tuple[int, ...]:
    return _ints("block_table", values)


def _non_neg_int(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{attr.name} must be an integer >= 0, got {value!r}")


@attrs.frozen
class SeqInput:
    """One sequence's share of a step.

    ``token_ids`` are the tokens to compute now, at positions ``start .. start + n - 1``;
    ``start`` is the number of tokens whose KV is already in the cache (a prefill chunk and a
    decode step are the same thing). ``block_table`` lists the KV block ids holding the
    sequence's tokens in order (token ``p`` sits in ``block_table[p // tokens_per_block]``);
    it must cover ``start + n`` tokens. ``all_logits``: return logits for every computed token,
    else only for the last.
    """

    token_ids: tuple[int, ...] = attrs.field(converter=_token_ids)
    start: int = attrs.field(validator=_non_neg_int)
    block_table: tuple[int, ...] = attrs.field(converter=_block_table)
    all_logits: bool = False

    @property
    def end(self) -> int:
        """Tokens in the cache after this step."""
        return self.start + len(self.token_ids)

    @property
    def n_logits(self) -> int:
        """Rows of logits this sequence gets."""
        return len(self.token_ids) if self.all_logits else 1


@attrs.frozen
class BatchInput:
    """Sequences computed together in one step. Logits rows come back in sequence order,
    ``seqs[i].n_logits`` rows each (see :meth:`split`)."""

    seqs: tuple[SeqInput, ...] = attrs.field(converter=tuple)

    def split(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence slices of a ``[rows, vocab]`` logits tensor."""
        out, row = [], 0
        for s in self.seqs:
            out.append(logits[row : row + s.n_logits])
            row += s.n_logits
        return out


@attrs.frozen(eq=False)
class _SeqAttn:
    """Attention work of one multi-token sequence: rows ``row0:row1`` of the batch attend
    the ``group.ctx`` positions of their sequence (``group.n == 1``)."""

    row0: int
    row1: int
    group: PagedGroup
    mask: torch.Tensor | None  # [n, ctx] bool, None when plain causal from position 0


@attrs.frozen(eq=False)
class _DecodeAttn:
    """Single-token sequences attended together: batch ``rows`` (a slice when consecutive,
    else an index tensor), their KV in ``group``."""

    rows: slice | torch.Tensor
    group: PagedGroup


@attrs.frozen(eq=False)
class _Plan:
    """Device tensors for one step: token ids, KV write slots, rotary tables ``[T, 1, hd]``,
    attention work and the rows that produce logits (None: every row, in order)."""

    ids: torch.Tensor
    slot_block: torch.Tensor
    slot_offset: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    multi: tuple[_SeqAttn, ...]
    decode: tuple[_DecodeAttn, ...]
    logit_rows: torch.Tensor | None

    @property
    def whole(self) -> PagedGroup | None:
        """The group of a step that is one decode chunk of every row in order, else None."""
        if self.multi or len(self.decode) != 1:
            return None
        rows = self.decode[0].rows
        if isinstance(rows, slice) and rows.start == 0 and rows.stop == self.ids.shape[0]:
            return self.decode[0].group
        return None


# ----------------------------------------------------------------------------- math


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as transformers computes it (in float32, the normalised value
    rounded to ``x``'s dtype, then times ``weight``). PyTorch's fused ``rms_norm`` accumulates
    in float32 for bf16 input and gives bit-identical results (checked) in one op where the
    spelled-out form is seven; decode runs it twice a layer."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


_FEW_ROWS: Final = 256
"""Up to this many rows :func:`linear` computes ``w @ x.T`` on CPU (see there)."""


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, contiguous: bool = False
) -> torch.Tensor:
    """``x @ w.T + b`` for ``x`` ``[M, in]``, ``w`` ``[out, in]``: ``[M, out]``.

    On CPU with at most :data:`_FEW_ROWS` rows it is computed as ``(w @ x.T).T``, and one row
    as ``mv``: PyTorch's CPU GEMM is faster with the weight as the left operand at decode
    sizes. Measured here (SmolLM2-135M's matmuls, bf16, one thread): M=1 36 -> 25 ms (mv),
    M=8 38 -> 25 ms, M=32 45 -> 31 ms; about equal at M=1024. The result is then a transposed
    view unless ``contiguous`` (callers that feed SDPA or hand rows out ask for it);
    elementwise ops and views accept either. Same products and sums as ``F.linear``; only the
    accumulation order inside the GEMM may differ.
    """
    m = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or m > _FEW_ROWS:
        return F.linear(x, w, b)
    if m == 1:
        y = torch.mv(w, x[0]) if b is None else torch.addmv(b, w, x[0])
        return y.unsqueeze(0)
    y = (torch.mm(w, x.t()) if b is None else torch.addmm(b.unsqueeze(1), w, x.t())).t()
    return y.contiguous() if contiguous else y


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by ``cos`` / ``signed_sin`` ``[T, 1, head_dim]``.

    transformers computes ``x * cos + cat(-x2, x1) * sin`` (``x1``, ``x2`` the halves of
    ``x``); here the sign sits in ``signed_sin`` (``sin`` with its first half negated, made
    once a step) and ``cat(x2, x1)`` is one ``roll``: the same products and sums, three ops
    fewer per call.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin


# ----------------------------------------------------------------------------- model


class LlamaModel:
    """Forward pass of a Llama-family model whose weights are the given views.

    The model keeps references to ``weights`` (e.g. from :func:`bind_weights`) and never
    copies them: copying new values into the views changes what the next forward computes.
    It also keeps a bounded attention scratch (:class:`~talaria.engine.attention.Scratch`,
    at most two tensors of :data:`~talaria.engine.attention.SCRATCH_BYTES`) reused by every
    step, so a model is not safe to run from two threads at once.
    """

    def __init__(
        self,
        arch: ModelArch,
        weights: Mapping[str, torch.Tensor],
        decode_kernel: DecodeKernel | None = None,
    ) -> None:
        self.arch = arch
        self.embed = _check_weights(arch, weights)
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        usable = decode_kernel is not None and self.device.type == "cpu"
        usable = usable and DecodeKernel.supports(
            arch.n_heads, arch.n_kv_heads, arch.head_dim, self.dtype
        )
        self.decode_kernel = decode_kernel if usable else None
        self.layers = tuple(_layer_views(weights, arch, i) for i in range(arch.n_layers))
        self.norm = weights["model.norm.weight"]
        self.lm_head = self.embed if arch.tie_word_embeddings else weights["lm_head.weight"]
        # the kernel's small product, when it takes every projection of this model (checked
        # once here: the views never change, so _linear checks only the batch size)
        self._gemm = self.decode_kernel
        if self._gemm is not None and not all(
            self._gemm.gemm_supports(w) for w in self._projections()
        ):
            self._gemm = None
        inv_freq, self._rope_scale = arch.rope_inv_freq()
        self._inv_freq = inv_freq.to(self.device)
        self.scratch = Scratch()

    @torch.no_grad()
    def forward(self, batch: BatchInput, kv: PagedKV) -> torch.Tensor:
        """Compute one step; returns logits ``[rows, vocab]`` in the weights' dtype.

        Mutates ``kv``: the K/V of every computed token is written to its slot (block
        ``block_table[p // tokens_per_block]``, offset ``p % tokens_per_block``). Raises
        ``BadRequest`` (``ContextTooLong`` past the context) before anything is written.
        """
        plan = self._plan(batch, kv)
        x = F.embedding(plan.ids, self.embed)
        eps = self.arch.rms_norm_eps
        for i, layer in enumerate(self.layers):  # x is this step's own tensor: add in place
            x.add_(self._attention(i, layer, rms_norm(x, layer.in_norm, eps), kv, plan))
            x.add_(self._mlp(layer, rms_norm(x, layer.post_norm, eps)))
        if plan.logit_rows is not None:
            x = x.index_select(0, plan.logit_rows)
        return self._linear(rms_norm(x, self.norm, eps), self.lm_head, contiguous=True)

    __call__ = forward

    def _linear(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None = None,
        contiguous: bool = False,
    ) -> torch.Tensor:
        """:func:`linear`, except up to ``MAX_SMALL_M`` bf16 rows go through the native
        kernel's small-batch product where there is one (small-batch decode reads every
        weight once per step; the kernel reads them near memory bandwidth)."""
        if self._gemm is not None and x.shape[0] <= MAX_SMALL_M:
            return self._gemm.gemm_small(x, w, b)  # validates x and b itself
        return linear(x, w, b, contiguous)

    def _projections(self) -> Iterable[torch.Tensor]:
        """Every weight :meth:`_linear` may be given, fused views included."""
        for layer in self.layers:
            yield from (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down)
            yield from (w for w in (layer.qkv, layer.gate_up) if w is not None)
        yield self.lm_head

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``down(silu(gate(h)) * up(h))``, ``h`` ``[T, hidden]``."""
        if layer.gate_up is not None:
            gate, up = self._linear(h, layer.gate_up).chunk(2, dim=-1)
        else:
            gate, up = self._linear(h, layer.gate), self._linear(h, layer.up)
        return self._linear(F.silu(gate).mul_(up), layer.down)

    def _qkv(self, layer: _Layer, h: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, ...]:
        """Rotated q ``[T, n_heads, hd]`` and k ``[T, n_kv_heads, hd]`` and v
        ``[T, n_kv_heads, hd]`` for ``h`` ``[T, hidden]`` (views of at most two tensors).

        With fused weights q and k are rotated together, as one ``[T, heads + kv_heads, hd]``.
        """
        a, t = self.arch, h.shape[0]
        nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
        if layer.qkv is not None and (layer.q_bias is None or layer.qkv_bias is not None):
            qkv = self._linear(h, layer.qkv, layer.qkv_bias, contiguous=True)
            qk = apply_rope(qkv[:, : (nh + nkv) * hd].view(t, nh + nkv, hd), plan.cos, plan.sin)
            return qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)
        q = self._linear(h, layer.q, layer.q_bias, contiguous=True).view(t, nh, hd)
        k = self._linear(h, layer.k, layer.k_bias, contiguous=True).view(t, nkv, hd)
        v = self._linear(h, layer.v, layer.v_bias, contiguous=True).view(t, nkv, hd)
        return apply_rope(q, plan.cos, plan.sin), apply_rope(k, plan.cos, plan.sin), v

    def _attention(
        self, i: int, layer: _Layer, h: torch.Tensor, kv: PagedKV, plan: _Plan
    ) -> torch.Tensor:
        """Attention block of layer ``i``: project, rotate, write K/V, attend, project out."""
        q, k, v = self._qkv(layer, h, plan)
        k_cache, v_cache = kv.layer(i)
        if k.dtype != kv.dtype:
            k, v = k.to(kv.dtype), v.to(kv.dtype)
        k_cache.index_put_((plan.slot_block, plan.slot_offset), k)
        v_cache.index_put_((plan.slot_block, plan.slot_offset), v)
        k_rows, v_rows = kv.rows(i)
        shape = (kv.tokens_per_block, self.arch.n_kv_heads, self.arch.head_dim)
        rows = h.shape[0]
        if plan.whole is not None:  # one decode chunk of every row, in order
            out = self._decode(q, k_rows, v_rows, plan.whole, shape)
        else:
            out = q.new_empty(q.shape)
            for s in plan.multi:
                out[s.row0 : s.row1] = attend_prefill(
                    q[s.row0 : s.row1], k_rows, v_rows, s.group, shape, self.scratch, s.mask
                )
            for d in plan.decode:
                out[d.rows] = self._decode(q[d.rows], k_rows, v_rows, d.group, shape)
        return self._linear(out.reshape(rows, -1), layer.o, layer.o_bias)

    def _decode(
        self,
        q: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
        g: PagedGroup,
        shape: tuple[int, int, int],
    ) -> torch.Tensor:
        """Decode attention of group ``g``: the native kernel reading the pool in place when
        there is one for this model and KV dtype, else gather + SDPA."""
        kernel = self.decode_kernel
        if kernel is not None and g.lengths is not None and k_rows.dtype == torch.bfloat16:
            scale = self.arch.head_dim**-0.5
            return kernel.attend(q, k_rows, v_rows, g.tables, g.lengths, shape[0], scale)
        return attend_decode(q, k_rows, v_rows, g, shape, self.scratch)

    # ------------------------------------------------------------------------- planning

    def _plan(self, batch: BatchInput, kv: PagedKV) -> _Plan:
        """Validate ``batch`` against the model and ``kv`` and build the step's tensors.

        Raises before anything is written; index lists are built in Python and each becomes
        one tensor on the model's device.
        """
        self._check_kv(kv)
        if not isinstance(batch, BatchInput) or not batch.seqs:
            raise BadRequest("a batch needs at least one sequence")
        tpb = kv.tokens_per_block
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        multi: list[_SeqAttn] = []
        decode: list[tuple[int, tuple[int, ...], int]] = []  # (row, used blocks, ctx)
        for i, seq in enumerate(batch.seqs):
            used = self._check_seq(i, seq, kv)
            row, n = len(ids), len(seq.token_ids)
            ids.extend(seq.token_ids)
            positions.extend(range(seq.start, seq.end))
            slots.extend(used[p // tpb] * tpb + p % tpb for p in range(seq.start, seq.end))
            if n == 1:
                decode.append((row, used, seq.end))
            else:
                multi.append(self._seq_attn(row, seq, used))
            logit_rows.extend(range(row if seq.all_logits else row + n - 1, row + n))
        if len(set(slots)) != len(slots):
            raise BadRequest("two sequences of the batch write the same KV slot")
        dev = self.device
        slot = torch.tensor(slots, dtype=torch.long)
        cos, sin = self._rope_tables(batch, torch.tensor(positions, dtype=torch.long))
        return _Plan(
            ids=torch.tensor(ids, dtype=torch.long).to(dev),
            slot_block=(slot // tpb).to(dev),
            slot_offset=(slot % tpb).to(dev),
            cos=cos,
            sin=sin,
            multi=tuple(multi),
            decode=self._decode_attn(decode, kv),
            logit_rows=None
            if len(logit_rows) == len(ids)
            else torch.tensor(logit_rows, dtype=torch.long).to(dev),
        )

    def _check_kv(self, kv: PagedKV) -> None:
        if kv.arch != self.arch:
            raise ConfigError("the KV view was made for a different model architecture")
        if kv.device != self.device:
            raise ConfigError(f"KV pool on {kv.device} but weights on {self.device}")

    def _check_seq(self, i: int, seq: SeqInput, kv: PagedKV) -> tuple[int, ...]:
        """Validate sequence ``i``; returns the block ids it uses (``ceil(end / tpb)``)."""
        if not isinstance(seq, SeqInput):
            raise BadRequest(f"seqs[{i}] must be a SeqInput, got {type(seq).__name__}")
        if not seq.token_ids:
            raise BadRequest(f"seqs[{i}].token_ids must not be empty")
        vocab = self.arch.vocab_size
        if not 0 <= min(seq.token_ids) <= max(seq.token_ids) < vocab:
            j, t = next((j, t) for j, t in enumerate(seq.token_ids) if not 0 <= t < vocab)
            raise BadRequest(
                f"seqs[{i}].token_ids[{j}] = {t} is outside the vocabulary 0..{vocab - 1}"
            )
        if seq.end > self.arch.max_context:
            raise ContextTooLong(
                f"seqs[{i}] reaches position {seq.end} but the model's context is "
                f"{self.arch.max_context} tokens"
            )
        tpb = kv.tokens_per_block
        n_blocks = -(-seq.end // tpb)
        if len(seq.block_table) < n_blocks:
            raise BadRequest(
                f"seqs[{i}].block_table has {len(seq.block_table)} blocks ({tpb} tokens each) "
                f"but {seq.end} tokens need {n_blocks}"
            )
        used = seq.block_table[:n_blocks]
        if not 0 <= min(used) <= max(used) < kv.num_blocks:
            bad = next(b for b in used if not 0 <= b < kv.num_blocks)
            raise BadRequest(
                f"seqs[{i}].block_table names block {bad}, outside 0..{kv.num_blocks - 1}"
            )
        if len(set(used)) != len(used):
            raise BadRequest(f"seqs[{i}].block_table lists a block twice")
        return used

    def _seq_attn(self, row: int, seq: SeqInput, used: tuple[int, ...]) -> _SeqAttn:
        n, dev = len(seq.token_ids), self.device
        mask = None
        if seq.start:
            query_pos = torch.arange(seq.start, seq.end).unsqueeze(1)
            mask = (torch.arange(seq.end).unsqueeze(0) <= query_pos).to(dev)
        blocks = torch.tensor(used, dtype=torch.long).to(dev)
        return _SeqAttn(row, row + n, PagedGroup(1, blocks, len(used), seq.end, None), mask)

    def _decode_attn(
        self, decode: list[tuple[int, tuple[int, ...], int]], kv: PagedKV
    ) -> tuple[_DecodeAttn, ...]:
        """Decode sequences ``(row, used blocks, ctx)`` in chunks whose gathered K fits the
        scratch limit (at least one sequence a chunk)."""
        k_rows = kv.rows(0)[0]
        limit = self.scratch.limit // (k_rows.shape[1] * k_rows.element_size())  # blocks a chunk
        chunks: list[_DecodeAttn] = []
        start, widest = 0, 0
        for j, (_, used, _) in enumerate(decode):
            if j > start and (j - start + 1) * max(widest, len(used)) > limit:
                chunks.append(self._decode_chunk(decode[start:j], kv))
                start, widest = j, 0
            widest = max(widest, len(used))
        if decode:
            chunks.append(self._decode_chunk(decode[start:], kv))
        return tuple(chunks)

    def _decode_chunk(
        self, part: list[tuple[int, tuple[int, ...], int]], kv: PagedKV
    ) -> _DecodeAttn:
        """One chunk: block tables padded to the longest (with the sequence's first block)
        and an additive mask over the padded positions when lengths differ."""
        dev = self.device
        width = max(len(used) for _, used, _ in part)
        blocks = [b for _, used, _ in part for b in (*used, *(used[0],) * (width - len(used)))]
        ctxs = [ctx for _, _, ctx in part]
        max_ctx = max(ctxs)
        mask = None
        if min(ctxs) < max_ctx:
            pad = torch.arange(max_ctx).unsqueeze(0) >= torch.tensor(ctxs).unsqueeze(1)
            mask = torch.zeros(pad.shape, dtype=self.dtype).masked_fill_(pad, float("-inf"))
            mask = mask[:, None, None, :].to(dev)
        lengths = torch.tensor(ctxs, dtype=torch.long) if dev.type == "cpu" else None
        group = PagedGroup(
            len(part), torch.tensor(blocks, dtype=torch.long).to(dev), width, max_ctx, mask, lengths
        )
        rows = [row for row, _, _ in part]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return _DecodeAttn(slice(rows[0], rows[0] + len(rows)), group)
        return _DecodeAttn(torch.tensor(rows, dtype=torch.long).to(dev), group)

    def _rope_tables(
        self, batch: BatchInput, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (first half negated, see :func:`apply_rope`) ``[T, 1, head_dim]``
        in the model dtype for ``positions`` ``[T]``.

        Dynamic NTK stretches per sequence by its own length (``start + n``), as transformers
        does for one sequence generating with a cache.
        """
        pos = positions.to(self.device).to(torch.float32)
        rs = self.arch.rope_scaling
        if rs is not None and rs.kind is RopeKind.DYNAMIC:
            per_seq = [
                self.arch.rope_inv_freq(s.end)[0].expand(len(s.token_ids), -1) for s in batch.seqs
            ]
            inv = torch.cat(per_seq).to(self.device)
            freqs = pos.unsqueeze(1) * inv
        else:
            freqs = pos.unsqueeze(1) * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos = (emb.cos() * self._rope_scale).to(self.dtype)
        sin = emb.sin() * self._rope_scale
        sin[..., : sin.shape[-1] // 2].neg_()
        return cos, sin.to(self.dtype)
