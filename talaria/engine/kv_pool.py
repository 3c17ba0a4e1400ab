"""The KV block pool of one instance: one device tensor and one host tensor, allocated once.

Each tier is a flat byte tensor of ``n_blocks * block_bytes`` bytes. Block ``b`` of a tier is
bytes ``[b * block_bytes, (b + 1) * block_bytes)``, the same for every model, as
:mod:`talaria.memory.kv` accounts them: the widest model (most KV bytes per token) defines
``block_bytes`` and a narrower model packs more tokens into a block.

:class:`PagedKV` is one model's view of one tier: per block
``[n_layers, 2 (K, V), tokens_per_block, n_kv_heads, head_dim]`` elements of the KV dtype,
made with ``torch.as_strided`` over the same storage (no copy); bytes past the model's
``tokens_per_block * kv_bytes_per_token`` in a block are unused. :meth:`PagedKV.rows` views one
layer's K (or V) as one row per block, the unit :mod:`talaria.engine.attention` gathers.

:meth:`KVPool.execute` runs a :class:`~talaria.memory.kv.MovePlan` (offload, restore) as one
batched gather and one batched scatter. The pools are never reallocated: their data pointers
are fixed for the pool's life, so views, kernels and CUDA graphs made once stay valid.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

import torch

from talaria.engine.arch import ModelArch
from talaria.errors import BadRequest, ConfigError
from talaria.memory.kv import MovePlan
from talaria.types import KVTier, Link

_LINK_TIERS: Final = MappingProxyType(
    {
        Link.DEVICE_TO_HOST: (KVTier.DEVICE, KVTier.HOST),
        Link.HOST_TO_DEVICE: (KVTier.HOST, KVTier.DEVICE),
        Link.DEVICE_TO_DEVICE: (KVTier.DEVICE, KVTier.DEVICE),
    }
)


def _word_dtype(block_bytes: int) -> torch.dtype:
    """The widest integer dtype dividing a block, for fast block copies."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if block_bytes % size == 0:
            return dtype
    return torch.uint8


def _count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class PagedKV:
    """One model's paged view of one tier of a :class:`KVPool` (no memory of its own).

    ``blocks`` is ``[num_blocks, n_layers, 2, tokens_per_block, n_kv_heads, head_dim]``;
    :meth:`layer` gives the K and V caches of one layer,
    ``[num_blocks, tokens_per_block, n_kv_heads, head_dim]`` each, and :meth:`rows` the same
    memory as ``[num_blocks, tokens_per_block * n_kv_heads * head_dim]``. Writing into them
    writes the pool.
    """

    def __init__(
        self, pool: torch.Tensor, block_bytes: int, arch: ModelArch, dtype: torch.dtype
    ) -> None:
        per_token = arch.kv_bytes_per_token(dtype)
        size = torch.empty((), dtype=dtype).element_size()
        if block_bytes % size:
            raise ConfigError(f"block_bytes ({block_bytes}) is not a multiple of {dtype}'s size")
        if block_bytes < per_token:
            raise ConfigError(
                f"block_bytes ({block_bytes}) is smaller than one token of KV ({per_token} bytes)"
            )
        self.arch = arch
        self.dtype = dtype
        self.block_bytes = block_bytes
        self.num_blocks = pool.numel() // block_bytes
        self.tokens_per_block = block_bytes // per_token
        tpb, kvh, hd = self.tokens_per_block, arch.n_kv_heads, arch.head_dim
        self.blocks = torch.as_strided(
            pool.view(dtype),
            (self.num_blocks, arch.n_layers, 2, tpb, kvh, hd),
            (block_bytes // size, 2 * tpb * kvh * hd, tpb * kvh * hd, kvh * hd, hd, 1),
        )
        self._layers = tuple(
            (self.blocks[:, i, 0], self.blocks[:, i, 1]) for i in range(arch.n_layers)
        )
        self._rows = tuple((k.flatten(1), v.flatten(1)) for k, v in self._layers)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches of layer ``i``, ``[num_blocks, tokens_per_block, kv_heads, hd]``."""
        return self._layers[i]

    def rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches of layer ``i`` as block rows,
        ``[num_blocks, tokens_per_block * kv_heads * hd]`` (views; a row is contiguous)."""
        return self._rows[i]

    def gather(self, i: int, table: list[int], n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer ``i``'s K and V for the first ``n_tokens`` tokens of a sequence
        whose blocks are ``table``: ``[n_tokens, kv_heads, hd]`` each."""
        idx = torch.tensor(table, dtype=torch.long, device=self.device)
        shape = (len(table) * self.tokens_per_block, self.arch.n_kv_heads, self.arch.head_dim)
        k, v = self._rows[i]
        return (
            k.index_select(0, idx).view(shape)[:n_tokens],
            v.index_select(0, idx).view(shape)[:n_tokens],
        )


class KVPool:
    """Device and host KV blocks of one instance, each tier one tensor allocated once.

    ``block_bytes`` is the size of a block in bytes; :meth:`block_bytes_for` computes it from
    the widest model and a block size in tokens. The host tier is pinned when the device is
    CUDA, so copies to and from it are direct DMA.
    """

    def __init__(
        self,
        device_blocks: int,
        host_blocks: int,
        block_bytes: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device_blocks = _count("device_blocks", device_blocks, 1)
        self.host_blocks = _count("host_blocks", host_blocks, 0)
        self.block_bytes = _count("block_bytes", block_bytes, 1)
        self.device = torch.device(device)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self.device_pool = torch.zeros(
            device_blocks * block_bytes, dtype=torch.uint8, device=self.device
        )
        self.host_pool = torch.zeros(host_blocks * block_bytes, dtype=torch.uint8, pin_memory=pin)
        word = _word_dtype(block_bytes)
        width = block_bytes // torch.empty((), dtype=word).element_size()
        self._rows = {
            KVTier.DEVICE: self.device_pool.view(word).view(device_blocks, width),
            KVTier.HOST: self.host_pool.view(word).view(host_blocks, width),
        }

    @staticmethod
    def block_bytes_for(archs: list[ModelArch], dtype: torch.dtype, block_size: int) -> int:
        """Bytes of a block holding ``block_size`` tokens of the widest of ``archs``."""
        if not archs:
            raise ConfigError("block_bytes_for needs at least one model")
        _count("block_size", block_size, 1)
        return block_size * max(a.kv_bytes_per_token(dtype) for a in archs)

    @property
    def nbytes(self) -> int:
        """Bytes of both tiers together."""
        return (self.device_blocks + self.host_blocks) * self.block_bytes

    def tokens_per_block(self, arch: ModelArch, dtype: torch.dtype) -> int:
        """Tokens of ``arch``'s KV (elements of ``dtype``) one block holds."""
        return self.block_bytes // arch.kv_bytes_per_token(dtype)

    def paged(self, arch: ModelArch, dtype: torch.dtype, tier: KVTier = KVTier.DEVICE) -> PagedKV:
        """``arch``'s view of one tier (DEVICE or HOST), KV elements of ``dtype``."""
        if tier is KVTier.DEVICE:
            return PagedKV(self.device_pool, self.block_bytes, arch, dtype)
        if tier is KVTier.HOST:
            return PagedKV(self.host_pool, self.block_bytes, arch, dtype)
        raise BadRequest(f"tier must be DEVICE or HOST, got {tier}")

    def block_rows(self, tier: KVTier) -> torch.Tensor:
        """One tier as ``[n_blocks, block_words]`` (a view; the word dtype divides a block)."""
        if tier not in self._rows:
            raise BadRequest(f"tier must be DEVICE or HOST, got {tier}")
        return self._rows[tier]

    def execute(self, plan: MovePlan) -> None:
        """Copy whole blocks as ``plan`` says: ``(source id, destination id)`` pairs over
        ``plan.link`` (DEVICE_TO_HOST, HOST_TO_DEVICE or DEVICE_TO_DEVICE).

        Sources are read before any destination is written, so a plan may reuse an id freed
        by one of its own moves. Raises ``BadRequest`` (nothing copied) for another link, a
        block size other than the pool's, an id out of range or a destination named twice.
        Returns when the copy is complete.
        """
        if not plan.moves:
            return
        if plan.link not in _LINK_TIERS:
            raise BadRequest(f"a KV pool cannot execute {plan.link.value} moves")
        if plan.block_bytes not in (0, self.block_bytes):
            raise BadRequest(
                f"plan blocks are {plan.block_bytes} bytes but the pool's are {self.block_bytes}"
            )
        src_tier, dst_tier = _LINK_TIERS[plan.link]
        src_rows, dst_rows = self._rows[src_tier], self._rows[dst_tier]
        srcs = [s for s, _ in plan.moves]
        dsts = [d for _, d in plan.moves]
        self._check_ids(srcs, src_rows.shape[0], f"{src_tier.value} source")
        self._check_ids(dsts, dst_rows.shape[0], f"{dst_tier.value} destination")
        if len(set(dsts)) != len(dsts):
            raise BadRequest("a move plan names one destination block twice")
        if src_tier is dst_tier and not set(srcs).isdisjoint(dsts):
            # a move reads a block another move writes: gather everything first
            data = src_rows.index_select(0, torch.tensor(srcs, device=src_rows.device))
            dst_idx = torch.tensor(dsts, device=dst_rows.device)
            dst_rows.index_copy_(0, dst_idx, data.to(dst_rows.device))
            return
        for s0, d0, n in _runs(plan.moves):  # plain slice copies: memcpy speed
            dst_rows[d0 : d0 + n].copy_(src_rows[s0 : s0 + n], non_blocking=True)
        if self.device_pool.is_cuda:
            torch.cuda.current_stream(self.device_pool.device).synchronize()

    @staticmethod
    def _check_ids(ids: list[int], n_blocks: int, what: str) -> None:
        for b in ids:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < n_blocks:
                raise BadRequest(f"{what} block {b!r} is outside 0..{n_blocks - 1}")


def _runs(moves: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int]]:
    """Moves coalesced into ``(first source, first destination, length)`` runs of blocks
    that are consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in moves:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            s0, d0, n = runs[-1]
            runs[-1] = (s0, d0, n + 1)
        else:
            runs.append((src, dst, 1))
    return runs
