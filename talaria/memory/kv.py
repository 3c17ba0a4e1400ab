"""KV block accounting for one instance: a device tier, a host tier and a prefix index.

Pure accounting: no torch, no I/O, no clock reads (callers pass ``now``). A substrate executes
the block moves this module plans (``MovePlan``); the simulator prices them.

Model of the memory
-------------------
* Device and host tiers each hold a fixed number of equal-sized blocks (``block_bytes``). A
  block holds ``tokens_per_block[model]`` tokens of one model's KV, so every model uses the
  same block bytes and a model with a smaller KV per token packs more tokens in a block.
* Full blocks are named by a chained content hash (``TokenSeq.block_hashes``) salted per
  (tenant, model): the prefix index maps hash -> the one place the block lives (device or
  host). Tenants never share a block.
* A running call holds references on its blocks; a *session table* lists the hashes of the
  session's latest history (its reusable prefix) between calls. A reservation *pins* the
  session's blocks. Blocks with no reference and no pin are cached: evictable.
* Eviction demotes device blocks to host before anything is dropped. Victims are chosen by
  value: orphan blocks (no session lists them) first, then the session whose return is least
  likely soon (``set_priority``) and least recent, each session tail-first so what stays on
  device is still a prefix. With ``Eviction.LRU`` the priority is ignored. When host is full
  the least valuable of the victims and the host blocks are dropped (tail-first again), so
  demoting a cheap block never displaces a more valuable host block.
* A session table lists hashes, present or not: a dropped block stays listed (its tokens are
  charged to the session) and counts again if the same content is computed later.
* Nothing is lost silently: every dropped block is counted, per session too.

Not thread-safe: the owning instance serializes all calls.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import attrs

from talaria.config import Eviction
from talaria.errors import BadRequest, OutOfBlocks, TalariaError
from talaria.types import Link, SessionId, TokenSeq, salt_for

CallKey = tuple[SessionId, int]
_Rank = tuple[int, float, float]  # eviction order of a candidate block; lower goes first
_ORPHAN: _Rank = (0, 0.0, 0.0)
_HELD: _Rank = (2, 0.0, 0.0)  # listed only by running or pinned sessions


class KVIntegrityError(TalariaError, RuntimeError):
    """The block accounting broke an invariant (a bug, never bad input)."""


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
    """Block copies for a substrate to execute, as (source block id, destination block id)."""

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
    was demoted or dropped to make room; a substrate executes ``evicted.demoted`` before
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


class _Block:
    """One hashed block. ``bid`` indexes the tier given by ``on_device``."""

    __slots__ = ("bid", "computed", "last_used", "on_device", "pin", "ref")

    def __init__(self, bid: int, on_device: bool, now: float) -> None:
        self.bid = bid
        self.on_device = on_device
        self.ref = 0  # running calls (or an in-flight restore) using it
        self.pin = 0  # reservations pinning it
        self.last_used = now
        self.computed = True


@attrs.define
class _CallState:
    session: SessionId
    model: str
    hashes: tuple[int, ...]  # hashes of the prompt's full blocks
    prompt_hashes: tuple[int, ...]  # hashed prompt blocks this call references
    shadows: list[int]  # private copies of prompt blocks indexed elsewhere (being computed)
    tail: list[int]  # blocks after the full prompt blocks (partial tail, output), in order

    @property
    def private(self) -> list[int]:
        """Device blocks the call holds that the prefix index does not name."""
        return self.shadows + self.tail


@attrs.define
class _SessionState:
    model: str
    tenant: str
    table: tuple[int, ...] = ()
    priority: float = 0.0
    last_used: float = 0.0
    pinned: tuple[int, ...] = ()
    dropped_tokens: int = 0
    running: bool = False
    n_device: int = 0  # table entries whose block is on device (lets eviction skip the rest)


_Victim = tuple[_Rank, int, _Block]


@attrs.define
class KVCounters:
    """Cumulative block movements (blocks, not bytes; multiply by ``block_bytes``)."""

    demoted_blocks: int = 0
    restored_blocks: int = 0
    dropped_blocks: int = 0
    allocated_blocks: int = 0


class KVManager:
    """Device and host KV blocks of one instance, with a prefix index.

    Mutating methods: ``allocate``, ``mark_computed``, ``finish``, ``abort``, ``pin``,
    ``unpin``, ``set_priority``, ``offload``, ``restore``, ``end_session``. Each either raises
    before changing anything (bad input, ``OutOfBlocks`` when the matching ``can_*`` check
    was skipped) or completes. Queries never mutate.
    """

    def __init__(
        self,
        device_blocks: int,
        host_blocks: int,
        block_bytes: int,
        tokens_per_block: Mapping[str, int],
        eviction: Eviction = Eviction.VALUE,
    ) -> None:
        if device_blocks <= 0:
            raise BadRequest(f"device_blocks must be positive, got {device_blocks}")
        if host_blocks < 0:
            raise BadRequest(f"host_blocks must be zero or positive, got {host_blocks}")
        if block_bytes <= 0:
            raise BadRequest(f"block_bytes must be positive, got {block_bytes}")
        if not tokens_per_block or any(t <= 0 for t in tokens_per_block.values()):
            raise BadRequest(f"tokens_per_block must be positive per model: {tokens_per_block}")
        self.device_blocks = device_blocks
        self.host_blocks = host_blocks
        self.block_bytes = block_bytes
        self.tokens_per_block = dict(tokens_per_block)
        self.eviction = eviction
        self.counters = KVCounters()
        self._dev_free: list[int] = list(range(device_blocks - 1, -1, -1))
        self._host_free: list[int] = list(range(host_blocks - 1, -1, -1))
        self._blocks: dict[int, _Block] = {}
        self._orphans: dict[int, None] = {}  # live hashes no table lists, oldest first
        self._listers: dict[int, list[_SessionState]] = {}  # hash -> tables listing it
        self._dev_held = 0  # device blocks (hashed or private) that may not be evicted
        self._calls: dict[CallKey, _CallState] = {}
        self._lent: list[int] = []  # free device blocks lent out (weight staging)
        self._sessions: dict[SessionId, _SessionState] = {}

    # ------------------------------------------------------------------ queries
    @property
    def device_free(self) -> int:
        return len(self._dev_free)

    @property
    def host_free(self) -> int:
        return len(self._host_free)

    @property
    def device_evictable(self) -> int:
        """Device blocks that eviction may take (cached, unpinned, unreferenced)."""
        return self.device_blocks - len(self._dev_free) - self._dev_held - len(self._lent)

    @property
    def device_available(self) -> int:
        return self.device_free + self.device_evictable

    @property
    def sessions(self) -> Mapping[SessionId, _SessionState]:
        return self._sessions

    def tpb(self, model: str) -> int:
        try:
            return self.tokens_per_block[model]
        except KeyError:
            raise BadRequest(f"model {model!r} has no KV layout on this instance") from None

    def hashes(self, model: str, tenant: str, tokens: TokenSeq) -> tuple[int, ...]:
        return tokens.block_hashes(self.tpb(model), salt_for(tenant, model))

    def match(self, model: str, tenant: str, tokens: TokenSeq) -> PrefixMatch:
        """Prefix of ``tokens`` with KV: leading device run, then host run. Pure."""
        tpb = self.tpb(model)
        dev, host = self._runs(self.hashes(model, tenant, tokens))
        return PrefixMatch(len(tokens), dev * tpb, host * tpb, tpb)

    def blocks_needed(self, model: str, tenant: str, tokens: TokenSeq, extra_tokens: int) -> int:
        """New device blocks an ``allocate`` of this call would take (device prefix reused)."""
        tpb = self.tpb(model)
        dev, _ = self._runs(self.hashes(model, tenant, tokens))
        return math.ceil((len(tokens) + extra_tokens) / tpb) - dev

    def can_allocate(self, model: str, tenant: str, tokens: TokenSeq, extra_tokens: int) -> bool:
        hashes = self.hashes(model, tenant, tokens)
        dev, _ = self._runs(hashes)
        n_total = math.ceil((len(tokens) + extra_tokens) / self.tpb(model))
        return n_total - dev <= self._available_besides(hashes[:dev])

    def _available_besides(self, reused: tuple[int, ...]) -> int:
        """Device blocks an allocation may take once it holds the ``reused`` blocks."""
        unheld = sum(1 for h in reused if not (b := self._blocks[h]).ref and not b.pin)
        return self.device_available - unheld

    def session_kv(self, session: SessionId) -> SessionKV:
        st = self._sessions.get(session)
        if st is None:
            return SessionKV(0, 0, 0)
        tpb = self.tpb(st.model)
        dev, host = self._runs(st.table)
        return SessionKV(dev * tpb, host * tpb, len(st.table) * tpb)

    def session_device_blocks(self, session: SessionId) -> int:
        """Device blocks listed in the session's table (shared ones included)."""
        st = self._sessions.get(session)
        if st is None:
            return 0
        return st.n_device

    def dropped_tokens(self, session: SessionId) -> int:
        st = self._sessions.get(session)
        return st.dropped_tokens if st else 0

    def _runs(self, hashes: tuple[int, ...]) -> tuple[int, int]:
        dev = host = 0
        for h in hashes:
            b = self._blocks.get(h)
            if b is None or not b.computed:
                break
            if b.on_device and host == 0:
                dev += 1
            elif not b.on_device:
                host += 1
            else:
                break
        return dev, host

    # ------------------------------------------------------------------ calls
    def allocate(
        self,
        key: CallKey,
        model: str,
        tenant: str,
        tokens: TokenSeq,
        extra_tokens: int,
        now: float,
    ) -> Allocation:
        """Commit device blocks for a call: reuse the device prefix, restore the host run,
        allocate the rest (prompt blocks to compute plus ``extra_tokens`` of output).

        Raises ``BadRequest`` for a duplicate call or a session already running a call, and
        ``OutOfBlocks`` (state unchanged) when ``can_allocate`` would have said no.
        """
        session = key[0]
        if key in self._calls:
            raise BadRequest(f"call {key} is already allocated")
        st = self._sessions.get(session)
        if st is not None and st.running:
            raise BadRequest(f"session {session!r} already has a call running")
        if st is not None and (st.model, st.tenant) != (model, tenant):
            raise BadRequest(f"session {session!r} belongs to model {st.model!r}")
        if extra_tokens < 0:
            raise BadRequest(f"extra_tokens must be zero or positive, got {extra_tokens}")
        tpb = self.tpb(model)
        hashes = self.hashes(model, tenant, tokens)
        dev, host = self._runs(hashes)
        n_total = math.ceil((len(tokens) + extra_tokens) / tpb)
        available = self._available_besides(hashes[:dev])
        if n_total - dev > available:
            raise OutOfBlocks(f"call {key} needs {n_total - dev} device blocks, {available} free")
        if st is None:
            st = self._sessions[session] = _SessionState(model, tenant)
        st.running = True
        st.last_used = now
        for h in hashes[: dev + host]:
            self._ref(self._blocks[h], now)
        evicted = self._make_room(n_total - dev - len(self._dev_free))
        restore = self._restore_blocks(hashes[dev : dev + host])
        prompt_hashes = list(hashes[: dev + host])
        device_ids = [self._blocks[h].bid for h in prompt_hashes]
        shadows: list[int] = []
        for h in hashes[dev + host :]:
            bid = self._take_device()
            device_ids.append(bid)
            if h in self._blocks:  # indexed elsewhere (being computed, or past a gap): private
                shadows.append(bid)
                continue
            blk = self._new_block(h, bid, now)
            blk.computed = False
            self._ref(blk, now)
            prompt_hashes.append(h)
        tail = [self._take_device() for _ in range(n_total - len(hashes))]
        device_ids.extend(tail)
        self._dev_held += len(shadows) + len(tail)
        self.counters.allocated_blocks += n_total - dev
        self._calls[key] = _CallState(session, model, hashes, tuple(prompt_hashes), shadows, tail)
        computed = len(tokens) - (dev + host) * tpb
        return Allocation(key, dev * tpb, host * tpb, computed, restore, evicted, tuple(device_ids))

    def mark_computed(self, key: CallKey) -> None:
        """The call's prompt KV is computed: its new full blocks become matchable."""
        call = self._call(key)
        for h in call.prompt_hashes:
            self._blocks[h].computed = True

    def finish(self, key: CallKey, history: TokenSeq, now: float) -> None:
        """The call answered; ``history`` is its prompt plus its output.

        The full output blocks of ``history`` are hashed and indexed in the blocks that hold
        them; the session's table becomes the leading run of ``history``'s full blocks that are
        indexed and computed; the partial tail, shadow copies and unused blocks are freed;
        references are dropped. Raises ``BadRequest`` if ``history`` does not start with the
        call's prompt.
        """
        call = self._call(key)
        st = self._sessions[call.session]
        hashes = self.hashes(call.model, st.tenant, history)
        if hashes[: len(call.hashes)] != call.hashes:
            raise BadRequest(f"the history of call {key} does not start with its prompt")
        self.mark_computed(key)
        kept = list(call.prompt_hashes)
        n_out = 0
        for h in hashes[len(call.hashes) :]:
            if n_out == len(call.tail) or h in self._blocks:
                break
            blk = self._new_block(h, call.tail[n_out], now)
            self._dev_held -= 1  # it leaves the private set; _ref counts it again
            self._ref(blk, now)
            kept.append(h)
            n_out += 1
        for bid in call.shadows + call.tail[n_out:]:
            self._free_private(bid)
        del self._calls[key]
        n_table = 0
        for h in hashes:
            blk_or_none = self._blocks.get(h)
            if blk_or_none is None or not blk_or_none.computed:
                break
            n_table += 1
        self._set_table(st, hashes[:n_table])
        for h in kept:
            self._unref(self._blocks[h])
        st.running = False
        st.last_used = now

    def abort(self, key: CallKey) -> None:
        """Release a call without keeping what it computed (uncomputed blocks are freed).

        Only the call that creates a block references it until it is computed, and pins take
        computed blocks only, so its uncomputed blocks are free once it lets go.
        """
        call = self._call(key)
        for h in call.prompt_hashes:
            blk = self._blocks[h]
            self._unref(blk)
            if not blk.computed and blk.ref == 0 and blk.pin == 0:
                del self._blocks[h]
                self._orphans.pop(h, None)
                self._dev_free.append(blk.bid)
                self._count_device(h, -1)
        for bid in call.private:
            self._free_private(bid)
        del self._calls[key]
        self._sessions[call.session].running = False

    # ------------------------------------------------------------------ sessions
    def set_priority(self, session: SessionId, value: float) -> None:
        """Value of keeping the session's KV on device (e.g. probability it returns soon).
        A value that is not a number (NaN) counts as the lowest, 0, so eviction ranks stay
        totally ordered whatever a policy computes."""
        st = self._sessions.get(session)
        if st is not None:
            st.priority = value if value == value else 0.0

    def pin(self, session: SessionId) -> int:
        """Pin the session's present (computed) blocks, a reservation: they are not evicted
        until ``unpin``. Returns the device blocks pinned (0 if already pinned)."""
        st = self._session(session)
        if st.pinned:
            return 0
        st.pinned = tuple(h for h in st.table if (b := self._blocks.get(h)) and b.computed)
        n_dev = 0
        for h in st.pinned:
            blk = self._blocks[h]
            if blk.on_device and blk.ref == 0 and blk.pin == 0:
                self._dev_held += 1
            n_dev += blk.on_device
            blk.pin += 1
        return n_dev

    def unpin(self, session: SessionId) -> None:
        st = self._session(session)
        for h in st.pinned:
            blk = self._blocks[h]
            blk.pin -= 1
            if blk.on_device and blk.ref == 0 and blk.pin == 0:
                self._dev_held -= 1
        st.pinned = ()

    def is_pinned(self, session: SessionId) -> bool:
        st = self._sessions.get(session)
        return bool(st and st.pinned)

    def offload(self, session: SessionId, now: float) -> EvictionResult:
        """Demote the session's unheld device blocks to host (dropped if host is full).

        Called when a reservation is reclaimed: the session's KV stays restorable.
        """
        st = self._session(session)
        rank = self._rank(st)
        victims = []
        for h in reversed(st.table):
            blk = self._blocks.get(h)
            if blk is not None and blk.on_device and not blk.ref and not blk.pin:
                victims.append((rank, h, blk))
        return self._demote_all(victims)

    def restore_blocks_needed(self, session: SessionId) -> int:
        st = self._session(session)
        return self._runs(st.table)[1]

    def can_restore(self, session: SessionId) -> bool:
        st = self._session(session)
        dev, host = self._runs(st.table)
        return host <= self._available_besides(st.table[:dev])

    def restore(self, session: SessionId, now: float) -> tuple[MovePlan, EvictionResult]:
        """Bring the session's host run back to device ahead of its next call (prefetch).

        The session's device run is kept (never evicted to make room for its own restore).
        Raises ``OutOfBlocks`` (state unchanged) when ``can_restore`` would have said no.
        """
        st = self._session(session)
        dev, host = self._runs(st.table)
        available = self._available_besides(st.table[:dev])
        if host > available:
            raise OutOfBlocks(f"restoring {session!r} needs {host} blocks, {available} free")
        prefix = st.table[: dev + host]
        for h in prefix:
            self._ref(self._blocks[h], now)
        evicted = self._make_room(host - len(self._dev_free))
        plan = self._restore_blocks(prefix[dev:])
        for h in prefix:
            self._unref(self._blocks[h])
        return plan, evicted

    @property
    def lent_blocks(self) -> int:
        return len(self._lent)

    def lend(self, n: int) -> tuple[int, ...]:
        """Lend ``n`` free device blocks (nothing is evicted for a loan), e.g. as a staging
        area for the next model's weights. Raises ``OutOfBlocks`` if fewer are free."""
        if n < 0 or n > len(self._dev_free):
            raise OutOfBlocks(f"cannot lend {n} blocks: {len(self._dev_free)} are free")
        ids = self._dev_free[len(self._dev_free) - n :]
        del self._dev_free[len(self._dev_free) - n :]
        ids.reverse()  # the same blocks, in the order single pops would take them
        self._lent.extend(ids)
        return tuple(ids)

    def return_lent(self) -> int:
        """Take back every lent block; returns how many."""
        n = len(self._lent)
        self._dev_free.extend(reversed(self._lent))
        self._lent.clear()
        return n

    def end_session(self, session: SessionId) -> bool:
        """Forget the session's table; its blocks become orphans (evicted first).

        Returns False (and changes nothing) while the session has a call running.
        """
        st = self._sessions.get(session)
        if st is None:
            return True
        if st.running:
            return False
        self.unpin(session)
        self._set_table(st, ())
        del self._sessions[session]
        return True

    # ------------------------------------------------------------------ internals
    def _call(self, key: CallKey) -> _CallState:
        call = self._calls.get(key)
        if call is None:
            raise BadRequest(f"unknown call {key}")
        return call

    def _session(self, session: SessionId) -> _SessionState:
        st = self._sessions.get(session)
        if st is None:
            raise BadRequest(f"unknown session {session!r} on this instance")
        return st

    def _ref(self, blk: _Block, now: float) -> None:
        if blk.on_device and blk.ref == 0 and blk.pin == 0:
            self._dev_held += 1
        blk.ref += 1
        blk.last_used = now

    def _unref(self, blk: _Block) -> None:
        blk.ref -= 1
        if blk.on_device and blk.ref == 0 and blk.pin == 0:
            self._dev_held -= 1

    def _take_device(self) -> int:
        if not self._dev_free:
            raise OutOfBlocks("no free device block (eviction was not planned)")
        return self._dev_free.pop()

    def _free_private(self, bid: int) -> None:
        self._dev_held -= 1
        self._dev_free.append(bid)

    def _new_block(self, h: int, bid: int, now: float) -> _Block:
        blk = self._blocks[h] = _Block(bid, True, now)
        if h in self._listers:
            self._count_device(h, 1)
        else:
            self._orphans[h] = None
        return blk

    def _count_device(self, h: int, delta: int) -> None:
        """Block ``h`` came to (+1) or left (-1) the device: tell the tables listing it."""
        for st in self._listers.get(h, ()):
            st.n_device += delta

    def _set_table(self, st: _SessionState, table: tuple[int, ...]) -> None:
        """Make ``table`` the session's table, keeping the lister index, device counts and
        orphans. Only what follows the common prefix of the two tables is touched.

        Blocks the old table leaves orphaned queue tail-first, so a prefix (which another
        session of the tenant may share, e.g. a system prompt) is evicted last.
        """
        blocks = self._blocks
        old = st.table
        same = 0
        for h_new, h_old in zip(table, old, strict=False):
            if h_new != h_old:
                break
            same += 1
        for h in table[same:]:
            listers = self._listers.get(h)
            if listers is None:
                self._listers[h] = [st]
                self._orphans.pop(h, None)
            else:
                listers.append(st)
            if (b := blocks.get(h)) and b.on_device:
                st.n_device += 1
        for h in reversed(old[same:]):
            listers = self._listers[h]
            listers.remove(st)
            if (b := blocks.get(h)) and b.on_device:
                st.n_device -= 1
            if not listers:
                del self._listers[h]
                if b:
                    self._orphans[h] = None
        st.table = table

    def _restore_blocks(self, run: tuple[int, ...]) -> MovePlan:
        moves: list[tuple[int, int]] = []
        for h in run:
            blk = self._blocks[h]
            dst = self._take_device()
            moves.append((blk.bid, dst))
            self._host_free.append(blk.bid)
            blk.bid = dst
            blk.on_device = True
            for st in self._listers.get(h, ()):
                st.n_device += 1
            if blk.ref or blk.pin:
                self._dev_held += 1
        self.counters.restored_blocks += len(moves)
        return MovePlan(Link.HOST_TO_DEVICE, tuple(moves), self.block_bytes)

    def _demote(self, h: int, blk: _Block) -> tuple[int, int]:
        """Move one unheld device block to a free host block."""
        src = blk.bid
        self._dev_free.append(src)
        blk.bid = self._host_free.pop()
        blk.on_device = False
        for st in self._listers.get(h, ()):
            st.n_device -= 1
        self.counters.demoted_blocks += 1
        return (src, blk.bid)

    def _drop(self, h: int) -> None:
        """Forget an unheld block for good, charging the sessions whose tables list it."""
        blk = self._blocks.pop(h)
        self._orphans.pop(h, None)
        if blk.on_device:
            self._dev_free.append(blk.bid)
            self._count_device(h, -1)
        else:
            self._host_free.append(blk.bid)
        self.counters.dropped_blocks += 1
        for st in self._listers.get(h, ()):
            st.dropped_tokens += self.tokens_per_block[st.model]

    def _demote_all(self, victims: Sequence[_Victim]) -> EvictionResult:
        """Demote device ``victims`` (least valuable first) to host. When host is short, the
        least valuable of the victims and of the host blocks are dropped; on equal value host
        blocks go first (they are the session's tail)."""
        n_drop = n_host = 0
        short = len(victims) - len(self._host_free)
        if short > 0:
            host = list(self._victims(on_device=False, limit=short)) if self.host_blocks else []
            while n_drop + n_host < short:
                if n_host < len(host) and (
                    n_drop == len(victims) or host[n_host][0] <= victims[n_drop][0]
                ):
                    n_host += 1
                else:
                    n_drop += 1
            for _rank, h, _blk in host[:n_host]:
                self._drop(h)
        for _rank, h, _blk in victims[:n_drop]:
            self._drop(h)
        moves = tuple(self._demote(h, blk) for _rank, h, blk in victims[n_drop:])
        return EvictionResult(MovePlan(Link.DEVICE_TO_HOST, moves, self.block_bytes), n_drop)

    def _make_room(self, n: int) -> EvictionResult:
        """Free ``n`` device blocks by demoting (or dropping) the least valuable ones."""
        if n <= 0:
            return EvictionResult(MovePlan(Link.DEVICE_TO_HOST, (), self.block_bytes), 0)
        victims = list(self._victims(on_device=True, limit=n))
        if len(victims) < n:
            raise KVIntegrityError(f"eviction found {len(victims)} of {n} evictable blocks")
        return self._demote_all(victims)

    def _victims(self, on_device: bool, limit: int) -> Iterator[_Victim]:
        """Up to ``limit`` distinct evictable blocks of one tier, least valuable first:
        orphans oldest first, then sessions by value, each tail-first."""
        seen: set[int] = set()
        for victim in self._candidates(on_device):
            if len(seen) >= limit:
                return
            if victim[1] not in seen:
                seen.add(victim[1])
                yield victim

    def _candidates(self, on_device: bool) -> Iterator[_Victim]:
        """Evictable blocks of one tier in eviction order, with their rank (lower goes first);
        a block listed by several sessions may come more than once."""
        blocks = self._blocks
        for h in self._orphans:
            b = blocks[h]
            if b.on_device is on_device and not b.ref and not b.pin:
                yield _ORPHAN, h, b
        order = sorted(
            (s for s in self._sessions.values() if not s.running and not s.pinned),
            key=self._value,
        )
        for st in order:
            rank = self._rank(st)
            for h in self._tail_first(st, on_device):
                b_or_none = blocks.get(h)
                if (
                    b_or_none is not None
                    and b_or_none.on_device is on_device
                    and not b_or_none.ref
                    and not b_or_none.pin
                ):
                    yield rank, h, b_or_none
        for h, b in blocks.items():  # listed only by running or pinned sessions' stale runs
            if b.on_device is on_device and not b.ref and not b.pin:
                yield _HELD, h, b

    def _tail_first(self, st: _SessionState, on_device: bool) -> Iterator[int]:
        """The session's table from the tail, skipping what cannot hold a block of the tier.

        A device scan usually needs only the leading device run: a session with no device
        block costs nothing, one whose device blocks are all in the run costs the run.
        """
        if not on_device:
            return reversed(st.table)
        if not st.n_device:
            return iter(())
        run = 0
        for h in st.table:
            b = self._blocks.get(h)
            if b is None or not b.on_device:
                break
            run += 1
        return reversed(st.table[:run] if run == st.n_device else st.table)

    def _value(self, st: _SessionState) -> tuple[float, float]:
        if self.eviction is Eviction.LRU:
            return (0.0, st.last_used)
        return (st.priority, st.last_used)

    def _rank(self, st: _SessionState) -> _Rank:
        """Eviction rank of a session's blocks: by value, after orphans, before held ones."""
        if st.running or st.pinned:
            return _HELD
        return (1, *self._value(st))

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Raise ``KVIntegrityError`` if any invariant is broken.

        Device: free + private + hashed-on-device == total, no block id owned twice. Host:
        free + hashed-on-host == total. Held count matches references and pins. The lister
        index and device counts match the tables; orphans are exactly the live blocks no
        table lists.
        Pins and call states only name live blocks; an uncomputed block is referenced; a
        session is running exactly while it has a call.
        """
        dev_owned: list[int] = list(self._dev_free) + self._lent
        host_owned: list[int] = list(self._host_free)
        held = 0
        for call in self._calls.values():
            dev_owned.extend(call.private)
            held += len(call.private)
        tabs: dict[int, list[int]] = {}
        pins: dict[int, int] = {}
        for st in self._sessions.values():
            for h in st.table:
                tabs.setdefault(h, []).append(id(st))
            n_device = sum(1 for h in st.table if (b := self._blocks.get(h)) and b.on_device)
            self._expect(st.n_device == n_device, f"device count {st.n_device} != {n_device}")
            for h in st.pinned:
                pins[h] = pins.get(h, 0) + 1
        refs: dict[int, int] = {}
        for call in self._calls.values():
            for h in call.prompt_hashes:
                refs[h] = refs.get(h, 0) + 1
        for h, blk in self._blocks.items():
            (dev_owned if blk.on_device else host_owned).append(blk.bid)
            held += blk.on_device and (blk.ref > 0 or blk.pin > 0)
            self._expect((h in self._orphans) == (h not in tabs), f"block {h}: orphan flag")
            self._expect(blk.pin == pins.get(h, 0), f"block {h}: pin {blk.pin}")
            self._expect(blk.ref == refs.get(h, 0), f"block {h}: ref {blk.ref}")
            self._expect(blk.computed or blk.ref > 0, f"block {h}: uncomputed, unreferenced")
        self._expect(
            {h: sorted(map(id, sts)) for h, sts in self._listers.items()}
            == {h: sorted(ids) for h, ids in tabs.items()},
            "table listers do not match the session tables",
        )
        self._expect(all(h in self._blocks for h in self._orphans), "a dead block is an orphan")
        self._check_ids(dev_owned, self.device_blocks, "device")
        self._check_ids(host_owned, self.host_blocks, "host")
        self._expect(held == self._dev_held, f"held {held} != counter {self._dev_held}")
        for st in self._sessions.values():
            for h in st.pinned:
                self._expect(h in self._blocks, f"pinned block {h} is not live")
        for call in self._calls.values():
            for h in call.prompt_hashes:
                self._expect(h in self._blocks, f"call block {h} is not live")
        running = {sid for sid, st in self._sessions.items() if st.running}
        callers = [call.session for call in self._calls.values()]
        self._expect(len(callers) == len(set(callers)), "a session runs two calls")
        self._expect(running == set(callers), "running flags do not match the calls")

    def _check_ids(self, owned: list[int], total: int, tier: str) -> None:
        self._expect(len(owned) == total, f"{tier}: {len(owned)} blocks accounted of {total}")
        self._expect(len(set(owned)) == len(owned), f"{tier}: a block is owned twice")
        self._expect(all(0 <= b < total for b in owned), f"{tier}: block id out of range")

    @staticmethod
    def _expect(ok: bool, what: str) -> None:
        if not ok:
            raise KVIntegrityError(what)
