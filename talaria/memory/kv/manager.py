"""``KVManager``: the KV memory of one instance, composed of a block pool (:mod:`.blocks`), a
prefix index with the session tables (:mod:`.prefix`) and an eviction ranking
(:mod:`.eviction`), plus the calls it has allocated.

The manager owns every mutation that spans those parts (allocating a call, finishing it,
pins, offload and restore, making room) and the counters; it returns the plain results of
:mod:`.types`. The package docstring (:mod:`talaria.memory.kv`) describes the memory model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import attrs

from talaria.config import Eviction
from talaria.errors import BadRequest, OutOfBlocks
from talaria.memory.kv.blocks import BlockPool, _Block
from talaria.memory.kv.eviction import EvictionOrder, _Victim, split_shortfall
from talaria.memory.kv.prefix import PrefixIndex, _SessionState
from talaria.memory.kv.types import (
    Allocation,
    CallKey,
    EvictionResult,
    KVCounters,
    KVHeld,
    KVIntegrityError,
    MovePlan,
    PrefixMatch,
    SessionKV,
    expect_invariant,
)
from talaria.types import Link, SessionKey, TokenSeq, salt_for


@attrs.define
class _CallState:
    session: SessionKey
    model: str
    hashes: tuple[int, ...]  # hashes of the prompt's full blocks
    prompt_hashes: tuple[int, ...]  # hashed prompt blocks this call references
    shadows: list[int]  # private copies of prompt blocks indexed elsewhere (being computed)
    tail: list[int]  # blocks after the full prompt blocks (partial tail, output), in order

    @property
    def private(self) -> list[int]:
        """Device blocks the call holds that the prefix index does not name."""
        return self.shadows + self.tail


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
        self.block_bytes = block_bytes
        self.tokens_per_block = dict(tokens_per_block)
        self.counters = KVCounters()
        self._pool = BlockPool(device_blocks, host_blocks)
        self._index = PrefixIndex()
        self._order = EvictionOrder(self._index, eviction)
        self._blocks = self._index.blocks  # the index's hash -> block map (read on hot paths)
        self._calls: dict[CallKey, _CallState] = {}

    # ------------------------------------------------------------------ queries
    @property
    def device_blocks(self) -> int:
        return self._pool.device_blocks

    @property
    def host_blocks(self) -> int:
        return self._pool.host_blocks

    @property
    def eviction(self) -> Eviction:
        return self._order.eviction

    @property
    def device_free(self) -> int:
        return self._pool.device_free

    @property
    def host_free(self) -> int:
        return self._pool.host_free

    @property
    def device_evictable(self) -> int:
        """Device blocks that eviction may take (cached, unpinned, unreferenced)."""
        return self._pool.device_evictable

    @property
    def device_available(self) -> int:
        return self.device_free + self.device_evictable

    @property
    def sessions(self) -> Mapping[SessionKey, _SessionState]:
        return self._index.sessions

    def tpb(self, model: str) -> int:
        try:
            return self.tokens_per_block[model]
        except KeyError:
            raise BadRequest(f"model {model!r} has no KV layout on this instance") from None

    def hashes(self, model: str, tenant: str, tokens: TokenSeq) -> tuple[int, ...]:
        return tokens.block_hashes(self.tpb(model), salt_for(tenant, model))

    def match(self, model: str, tenant: str, tokens: TokenSeq) -> PrefixMatch:
        """Prefix of ``tokens`` with KV: leading device run, then host run (see
        :meth:`_prompt_runs`: never the block holding the last token). Pure."""
        tpb = self.tpb(model)
        dev, host = self._prompt_runs(tpb, self.hashes(model, tenant, tokens), len(tokens))
        return PrefixMatch(len(tokens), dev * tpb, host * tpb, tpb)

    def holds_prefix(self, model: str, tenant: str, tokens: TokenSeq) -> bool:
        """Whether ``match`` would find any KV (device or host) for ``tokens``: False means
        its match is empty, found with one lookup instead of a walk of the prefix. Pure."""
        tpb = self.tpb(model)
        if len(tokens) <= tpb:  # no full block before the one holding the last token
            return False
        blk = self._blocks.get(self.hashes(model, tenant, tokens)[0])
        return blk is not None and blk.computed

    def _prompt_runs(self, tpb: int, hashes: tuple[int, ...], n_tokens: int) -> tuple[int, int]:
        """The cached runs (device blocks, then host blocks) a call of ``n_tokens`` prompt
        tokens may reuse: at most the full blocks before the one holding its last token. A
        call computes at least its last token (for its logits), and that token's KV must go
        to a block of its own: when a whole prompt is cached its last block is recomputed in
        a private block (as vLLM does), never rewritten in the shared one, where calls with
        the same prompt in one batch (``n`` > 1) would all write the same slot."""
        return self._index.runs(hashes[: max(0, n_tokens - 1) // tpb])

    def blocks_needed(self, model: str, tenant: str, tokens: TokenSeq, extra_tokens: int) -> int:
        """New device blocks an ``allocate`` of this call would take (device prefix reused)."""
        tpb = self.tpb(model)
        dev, _ = self._prompt_runs(tpb, self.hashes(model, tenant, tokens), len(tokens))
        return math.ceil((len(tokens) + extra_tokens) / tpb) - dev

    def can_allocate(self, model: str, tenant: str, tokens: TokenSeq, extra_tokens: int) -> bool:
        hashes = self.hashes(model, tenant, tokens)
        dev, _ = self._prompt_runs(self.tpb(model), hashes, len(tokens))
        n_total = math.ceil((len(tokens) + extra_tokens) / self.tpb(model))
        return n_total - dev <= self._available_besides(hashes[:dev])

    def _available_besides(self, reused: tuple[int, ...]) -> int:
        """Device blocks an allocation may take once it holds the ``reused`` blocks."""
        unheld = sum(1 for h in reused if not (b := self._blocks[h]).ref and not b.pin)
        return self.device_available - unheld

    def session_kv(self, session: SessionKey) -> SessionKV:
        st = self._index.sessions.get(session)
        if st is None:
            return SessionKV(0, 0, 0)
        tpb = self.tpb(st.model)
        dev, host = self._index.runs(st.table)
        return SessionKV(dev * tpb, host * tpb, len(st.table) * tpb)

    def session_device_blocks(self, session: SessionKey) -> int:
        """Device blocks listed in the session's table (shared ones included)."""
        st = self._index.sessions.get(session)
        if st is None:
            return 0
        return st.n_device

    def dropped_tokens(self, session: SessionKey) -> int:
        st = self._index.sessions.get(session)
        return st.dropped_tokens if st else 0

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
        st = self._check_new_call(key, model, tenant, extra_tokens)
        tpb = self.tpb(model)
        hashes = self.hashes(model, tenant, tokens)
        dev, host = self._prompt_runs(tpb, hashes, len(tokens))
        n_total = math.ceil((len(tokens) + extra_tokens) / tpb)
        available = self._available_besides(hashes[:dev])
        if n_total - dev > available:
            raise OutOfBlocks(f"call {key} needs {n_total - dev} device blocks, {available} free")
        if st is None:
            st = self._index.add_session(session, model, tenant)
        self._index.set_running(session, True)
        st.last_used = now
        for h in hashes[: dev + host]:
            self._pool.ref(self._blocks[h], now)
        evicted = self._make_room(n_total - dev - self._pool.device_free)
        restore = self._restore_blocks(hashes[dev : dev + host])
        prompt_hashes, shadows, device_ids = self._take_prompt_blocks(hashes, dev + host, now)
        tail = [self._pool.take_device() for _ in range(n_total - len(hashes))]
        device_ids.extend(tail)
        self._pool.hold(len(shadows) + len(tail))
        self.counters.allocated_blocks += n_total - dev
        self._calls[key] = _CallState(session, model, hashes, tuple(prompt_hashes), shadows, tail)
        computed = len(tokens) - (dev + host) * tpb
        return Allocation(key, dev * tpb, host * tpb, computed, restore, evicted, tuple(device_ids))

    def _check_new_call(
        self, key: CallKey, model: str, tenant: str, extra_tokens: int
    ) -> _SessionState | None:
        """The session of a call ``allocate`` may start (None if new); raises ``BadRequest``."""
        session = key[0]
        if key in self._calls:
            raise BadRequest(f"call {key} is already allocated")
        st = self._index.sessions.get(session)
        if st is not None and st.running:
            raise BadRequest(f"session {session!r} already has a call running")
        if st is not None and (st.model, st.tenant) != (model, tenant):
            raise BadRequest(f"session {session!r} belongs to model {st.model!r}")
        if extra_tokens < 0:
            raise BadRequest(f"extra_tokens must be zero or positive, got {extra_tokens}")
        return st

    def _take_prompt_blocks(
        self, hashes: tuple[int, ...], n_present: int, now: float
    ) -> tuple[list[int], list[int], list[int]]:
        """Device blocks for a call's full prompt blocks, the first ``n_present`` already on
        device (referenced by the caller). Each other block is indexed as uncomputed and
        referenced, or a private shadow when its hash is indexed elsewhere (being computed,
        or past a gap). Returns (referenced hashes, shadow ids, block table so far)."""
        prompt_hashes = list(hashes[:n_present])
        device_ids = [self._blocks[h].bid for h in prompt_hashes]
        shadows: list[int] = []
        for h in hashes[n_present:]:
            bid = self._pool.take_device()
            device_ids.append(bid)
            if h in self._blocks:  # indexed elsewhere (being computed, or past a gap): private
                shadows.append(bid)
                continue
            blk = self._index.new_block(h, bid, now)
            blk.computed = False
            self._pool.ref(blk, now)
            prompt_hashes.append(h)
        return prompt_hashes, shadows, device_ids

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
        st = self._index.sessions[call.session]
        hashes = self.hashes(call.model, st.tenant, history)
        if hashes[: len(call.hashes)] != call.hashes:
            raise BadRequest(f"the history of call {key} does not start with its prompt")
        self.mark_computed(key)
        kept = list(call.prompt_hashes)
        n_out = 0
        for h in hashes[len(call.hashes) :]:
            if n_out == len(call.tail) or h in self._blocks:
                break
            blk = self._index.new_block(h, call.tail[n_out], now)
            self._pool.adopt(blk, now)
            kept.append(h)
            n_out += 1
        for bid in call.shadows + call.tail[n_out:]:
            self._pool.free_private(bid)
        del self._calls[key]
        self._index.set_table(st, hashes[: self._index.computed_run(hashes)])
        for h in kept:
            self._pool.unref(self._blocks[h])
        self._index.set_running(call.session, False)
        st.last_used = now

    def abort(self, key: CallKey) -> None:
        """Release a call without keeping what it computed (uncomputed blocks are freed).

        Only the call that creates a block references it until it is computed, and pins take
        computed blocks only, so its uncomputed blocks are free once it lets go.
        """
        call = self._call(key)
        for h in call.prompt_hashes:
            blk = self._blocks[h]
            self._pool.unref(blk)
            if not blk.computed and blk.ref == 0 and blk.pin == 0:
                self._pool.release(self._index.remove(h))
        for bid in call.private:
            self._pool.free_private(bid)
        del self._calls[key]
        self._index.set_running(call.session, False)

    # ------------------------------------------------------------------ sessions
    def set_priority(self, session: SessionKey, value: float) -> None:
        """Value of keeping the session's KV on device (e.g. probability it returns soon).
        A value that is not a number (NaN) counts as the lowest, 0, so eviction ranks stay
        totally ordered whatever a policy computes."""
        st = self._index.sessions.get(session)
        if st is not None:
            st.priority = value if value == value else 0.0

    def pin(self, session: SessionKey) -> int:
        """Pin the session's present (computed) blocks, a reservation: they are not evicted
        until ``unpin``. Returns the device blocks pinned (0 if already pinned)."""
        st = self._index.session(session)
        if st.pinned:
            return 0
        self._index.set_pinned(
            session, tuple(h for h in st.table if (b := self._blocks.get(h)) and b.computed)
        )
        n_dev = 0
        for h in st.pinned:
            blk = self._blocks[h]
            n_dev += blk.on_device
            self._pool.pin(blk)
        return n_dev

    def unpin(self, session: SessionKey) -> None:
        st = self._index.session(session)
        for h in st.pinned:
            self._pool.unpin(self._blocks[h])
        self._index.set_pinned(session, ())

    def is_pinned(self, session: SessionKey) -> bool:
        st = self._index.sessions.get(session)
        return bool(st and st.pinned)

    def offload(self, session: SessionKey, now: float) -> EvictionResult:
        """Demote the session's unheld device blocks to host (dropped if host is full).

        Called when a reservation is reclaimed: the session's KV stays restorable.
        """
        st = self._index.session(session)
        rank = self._order.rank(st)
        victims = []
        for h in reversed(st.table):
            blk = self._blocks.get(h)
            if blk is not None and blk.on_device and not blk.ref and not blk.pin:
                victims.append((rank, h, blk))
        return self._demote_all(victims)

    def restore_blocks_needed(self, session: SessionKey) -> int:
        st = self._index.session(session)
        return self._index.runs(st.table)[1]

    def can_restore(self, session: SessionKey) -> bool:
        st = self._index.session(session)
        dev, host = self._index.runs(st.table)
        return host <= self._available_besides(st.table[:dev])

    def restore(self, session: SessionKey, now: float) -> tuple[MovePlan, EvictionResult]:
        """Bring the session's host run back to device ahead of its next call (prefetch).

        The session's device run is kept (never evicted to make room for its own restore).
        Raises ``OutOfBlocks`` (state unchanged) when ``can_restore`` would have said no.
        """
        st = self._index.session(session)
        dev, host = self._index.runs(st.table)
        available = self._available_besides(st.table[:dev])
        if host > available:
            raise OutOfBlocks(f"restoring {session!r} needs {host} blocks, {available} free")
        prefix = st.table[: dev + host]
        for h in prefix:
            self._pool.ref(self._blocks[h], now)
        evicted = self._make_room(host - self._pool.device_free)
        plan = self._restore_blocks(prefix[dev:])
        for h in prefix:
            self._pool.unref(self._blocks[h])
        return plan, evicted

    @property
    def lent_blocks(self) -> int:
        return len(self._pool.lent)

    def lend(self, n: int) -> tuple[int, ...]:
        """Lend ``n`` free device blocks (nothing is evicted for a loan), e.g. as a staging
        area for the next model's weights. Raises ``OutOfBlocks`` if fewer are free."""
        return self._pool.lend(n)

    def return_lent(self) -> int:
        """Take back every lent block; returns how many."""
        return self._pool.return_lent()

    def can_vacate(self) -> bool:
        """Whether ``vacate`` may run: no call allocated, no pin, no loan (every device block
        is free or evictable)."""
        pool = self._pool
        return (
            not self._calls
            and not pool.lent
            and pool.device_free + pool.device_evictable == (pool.device_blocks)
        )

    def vacate(self) -> EvictionResult:
        """Empty the device tier (the instance scales to zero): every cached device block is
        demoted to host, least valuable first, and dropped where host is short (as eviction
        does), so sessions keep what host holds. Raises ``KVHeld`` (state unchanged) where
        ``can_vacate`` would say no."""
        if not self.can_vacate():
            raise KVHeld(
                f"{len(self._calls)} calls, {len(self._pool.lent)} lent blocks and pins hold "
                f"device blocks: {self.device_blocks - self.device_available} held"
            )
        return self._make_room(self.device_evictable)

    def end_session(self, session: SessionKey) -> bool:
        """Forget the session's table; its blocks become orphans (evicted first).

        Returns False (and changes nothing) while the session has a call running.
        """
        st = self._index.sessions.get(session)
        if st is None:
            return True
        if st.running:
            return False
        self.unpin(session)
        self._index.set_table(st, ())
        self._index.drop_session(session)
        return True

    # ------------------------------------------------------------------ internals
    def _call(self, key: CallKey) -> _CallState:
        call = self._calls.get(key)
        if call is None:
            raise BadRequest(f"unknown call {key}")
        return call

    def _restore_blocks(self, run: tuple[int, ...]) -> MovePlan:
        moves: list[tuple[int, int]] = []
        for h in run:
            moves.append(self._pool.to_device(self._blocks[h]))
            self._index.count_device(h, 1)
        self.counters.restored_blocks += len(moves)
        return MovePlan(Link.HOST_TO_DEVICE, tuple(moves), self.block_bytes)

    def _demote(self, h: int, blk: _Block) -> tuple[int, int]:
        """Move one unheld device block to a free host block."""
        move = self._pool.to_host(blk)
        self._index.count_device(h, -1)
        self.counters.demoted_blocks += 1
        return move

    def _drop(self, h: int) -> None:
        """Forget an unheld block for good, charging the sessions whose tables list it."""
        self._pool.release(self._index.remove(h))
        self.counters.dropped_blocks += 1
        self._index.charge_dropped(h, self.tokens_per_block)

    def _demote_all(self, victims: Sequence[_Victim]) -> EvictionResult:
        """Demote device ``victims`` (least valuable first) to host. When host is short, the
        least valuable of the victims and of the host blocks are dropped; on equal value host
        blocks go first (they are the session's tail)."""
        n_drop = 0
        short = len(victims) - self._pool.host_free
        if short > 0:
            host = list(self._victims(on_device=False, limit=short)) if self.host_blocks else []
            n_drop, n_host = split_shortfall(victims, host, short)
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
        """Up to ``limit`` distinct evictable blocks of one tier, least valuable first (the
        ranking's ``EvictionOrder.victims``)."""
        return self._order.victims(on_device, limit)

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
        calls = self._calls.values()
        refs: dict[int, int] = {}
        for call in calls:
            for h in call.prompt_hashes:
                refs[h] = refs.get(h, 0) + 1
        self._index.check_integrity(refs)
        private = [bid for call in calls for bid in call.private]
        self._pool.check_integrity(self._blocks.values(), private)
        for call in calls:
            for h in call.prompt_hashes:
                expect_invariant(h in self._blocks, f"call block {h} is not live")
        running = {sid for sid, st in self._index.sessions.items() if st.running}
        callers = [call.session for call in calls]
        expect_invariant(len(callers) == len(set(callers)), "a session runs two calls")
        expect_invariant(running == set(callers), "running flags do not match the calls")
