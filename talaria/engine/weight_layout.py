"""Binding a model's parameters as views of one flat weight region, and per-layer views.

:func:`bind_weights` carves every parameter of a :class:`~talaria.engine.arch.ModelArch` as a
view of one flat, preallocated region, in a fixed order
(:meth:`~talaria.engine.arch.ModelArch.param_shapes`), so a model's parameters always sit at
the same addresses. Loading a model is copying into these views; nothing is reallocated, so
data pointers never change. :func:`check_weights` validates a set of such views and
:func:`layer_views` groups one decoder layer's views into a :class:`Layer`, with fused q/k/v
and gate/up views where the parts are adjacent, for :class:`~talaria.engine.model.LlamaModel`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs
import torch

from talaria.engine.arch import ModelArch, element_size
from talaria.errors import ConfigError


def _typed_flat(region: torch.Tensor, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of ``region`` as a flat ``dtype`` tensor sharing its storage."""
    if not isinstance(region, torch.Tensor) or region.dim() != 1 or not region.is_contiguous():
        raise ConfigError("region must be a 1-D contiguous tensor (uint8 bytes or the dtype)")
    size = element_size(dtype)
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
class Layer:
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


def layer_views(weights: Mapping[str, torch.Tensor], arch: ModelArch, i: int) -> Layer:
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    q, k, v = (weights[f"{attn}{n}_proj.weight"] for n in "qkv")
    biases = [weights.get(f"{attn}{n}_proj.bias") for n in "qkv"]
    fused_bias = None
    if biases[0] is not None and biases[1] is not None and biases[2] is not None:
        fused_bias = _adjacent([biases[0], biases[1], biases[2]])
    gate, up = weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]
    return Layer(
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


def check_weights(arch: ModelArch, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
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
    element_size(embed.dtype)
    return embed
