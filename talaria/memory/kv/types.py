"""Plain data of the KV block manager: call keys, the results its methods return, its
cumulative counters and the error an invariant check raises.

No behaviour beyond derived properties: :mod:`.manager` builds these, executors and policies
read them (``MovePlan`` is what an executor executes and the simulator prices).
"""

from __future__ import annotations

import attrs

from talaria.errors import TalariaError
from talaria.types import Link, SessionKey

CallKey = tuple[SessionKey, int]


class KVIntegrityError(TalariaError, RuntimeError):
    """The block accounting broke an invariant (a bug, never bad input)."""


class KVHeld(TalariaError, RuntimeError):
    """``vacate`` while a call, a pin or a loan still holds device blocks (a caller skipped
    ``can_vacate``)."""

    code = "kv_held"


def expect_invariant(ok: bool, what: str) -> None:
    """Raise ``KVIntegrityError(what)`` unless ``ok`` (the integrity checks' one test)."""
    if not ok:
        raise KVIntegrityError(what)


@attrs.frozen
class PrefixMatch:
    """How much of a token sequence's prefix has KV: a device run, then a host run (tokens)."""

    total_tokens: int
    device_tokens: int
    host_tokens: int
    tokens_per_block: int

    @property
    def gone_tokens(self) -> int:
        """Tokens that must be computed (recomputed if they were cached once)."""
        return self.total_tokens - self.device_tokens - self.host_tokens

    @property
    def device_blocks(self) -> int:
        return self.device_tokens // self.tokens_per_block

    @property
    def host_blocks(self) -> int:
        return self.host_tokens // self.tokens_per_block


@attrs.frozen
class MovePlan:
    """Block copies for an executor to execute, as (source block id, destination block id)."""

    link: Link
    moves: tuple[tuple[int, int], ...] = ()
    block_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.moves) * self.block_bytes

    def __len__(self) -> int:
        return len(self.moves)


@attrs.frozen
class EvictionResult:
    """What making room did: device->host demotions and blocks dropped for good."""

    demoted: MovePlan
    dropped_blocks: int


@attrs.frozen
class Allocation:
    """A committed allocation for one call (``KVManager.allocate``).

    ``reused_tokens`` were on device, ``restored_tokens`` come back from host by the
    ``restore`` plan, ``computed_tokens`` of the prompt must be prefilled. ``evicted`` is what
    was demoted or dropped to make room; an executor executes ``evicted.demoted`` before
    ``restore`` (block ids may be reused). ``device_blocks`` is the call's block table in token
    order: block ``i`` holds tokens ``[i * tpb, (i + 1) * tpb)`` of the prompt then the output.
    """

    key: CallKey
    reused_tokens: int
    restored_tokens: int
    computed_tokens: int
    restore: MovePlan
    evicted: EvictionResult
    device_blocks: tuple[int, ...]


@attrs.frozen
class SessionKV:
    """Where a session's reusable prefix is: leading device run, then host run (tokens)."""

    device_tokens: int
    host_tokens: int
    table_tokens: int

    @property
    def gone_tokens(self) -> int:
        return self.table_tokens - self.device_tokens - self.host_tokens


@attrs.define
class KVCounters:
    """Cumulative block movements (blocks, not bytes; multiply by ``block_bytes``)."""

    demoted_blocks: int = 0
    restored_blocks: int = 0
    dropped_blocks: int = 0
    allocated_blocks: int = 0
