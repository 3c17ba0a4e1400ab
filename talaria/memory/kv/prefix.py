"""The prefix index and the per-session tables of one instance.

``PrefixIndex`` maps a chained content hash to the one ``_Block`` (:mod:`.blocks`) holding it,
on device or host, and keeps each session's table (the hashes of its latest history, present
or not) with the reverse index from a hash to the tables listing it. A live block no table
lists is an *orphan*; orphans are kept oldest first, the order eviction takes them.

It moves no block ids (that is the pool's, :mod:`.blocks`) and ranks nothing (that is
:mod:`.eviction`'s); the manager (:mod:`.manager`) drives the three together.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from talaria.errors import BadRequest
from talaria.memory.kv.blocks import _Block
from talaria.memory.kv.types import expect_invariant
from talaria.types import SessionKey


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
    seq: int = 0  # order of creation in its index (eviction's last tie-break)


class PrefixIndex:
    """Hash -> block, the session tables, the tables listing each hash, and the orphans.

    Each session's ``n_device`` counts its table entries whose block is on device; every
    change of a block's tier or life goes through ``count_device`` so the counts stay exact.
    ``idle`` holds the sessions neither running nor pinned, the only ones whose blocks
    eviction ranks by value: sessions are created and dropped through ``add_session`` and
    ``drop_session``, and ``running`` and ``pinned`` change through ``set_running`` and
    ``set_pinned`` alone.
    """

    def __init__(self) -> None:
        self.blocks: dict[int, _Block] = {}
        self.orphans: dict[int, None] = {}  # live hashes no table lists, oldest first
        self.listers: dict[int, list[_SessionState]] = {}  # hash -> tables listing it
        self.sessions: dict[SessionKey, _SessionState] = {}
        self.idle: dict[SessionKey, _SessionState] = {}  # neither running nor pinned
        self._created = 0

    def add_session(self, session: SessionKey, model: str, tenant: str) -> _SessionState:
        """A new, idle session with an empty table."""
        self._created += 1
        st = self.sessions[session] = self.idle[session] = _SessionState(
            model, tenant, seq=self._created
        )
        return st

    def drop_session(self, session: SessionKey) -> None:
        """Forget a session (its table must already be empty: see ``set_table``)."""
        del self.sessions[session]
        self.idle.pop(session, None)

    def set_running(self, session: SessionKey, running: bool) -> _SessionState:
        """Mark the session running (a call holds it) or not, keeping ``idle`` in step."""
        st = self.sessions[session]
        st.running = running
        self._settle(session, st)
        return st

    def set_pinned(self, session: SessionKey, pinned: tuple[int, ...]) -> _SessionState:
        """Make ``pinned`` the session's pinned hashes, keeping ``idle`` in step."""
        st = self.sessions[session]
        st.pinned = pinned
        self._settle(session, st)
        return st

    def _settle(self, session: SessionKey, st: _SessionState) -> None:
        if st.running or st.pinned:
            self.idle.pop(session, None)
        else:
            self.idle[session] = st

    # ------------------------------------------------------------------ queries
    def session(self, session: SessionKey) -> _SessionState:
        st = self.sessions.get(session)
        if st is None:
            raise BadRequest(f"unknown session {session!r} on this instance")
        return st

    def runs(self, hashes: tuple[int, ...]) -> tuple[int, int]:
        """Blocks of the leading device run of ``hashes``, then of the host run after it."""
        dev = host = 0
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or not b.computed:
                break
            if b.on_device and host == 0:
                dev += 1
            elif not b.on_device:
                host += 1
            else:
                break
        return dev, host

    def computed_run(self, hashes: tuple[int, ...]) -> int:
        """Length of the leading run of ``hashes`` that are indexed and computed."""
        n = 0
        for h in hashes:
            blk_or_none = self.blocks.get(h)
            if blk_or_none is None or not blk_or_none.computed:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ blocks
    def new_block(self, h: int, bid: int, now: float) -> _Block:
        """Index a new device block ``bid`` under hash ``h`` (an orphan if no table lists it)."""
        blk = self.blocks[h] = _Block(bid, True, now)
        if h in self.listers:
            self.count_device(h, 1)
        else:
            self.orphans[h] = None
        return blk

    def remove(self, h: int) -> _Block:
        """Forget block ``h``; the caller frees its id. Tables listing it keep the hash."""
        blk = self.blocks.pop(h)
        self.orphans.pop(h, None)
        if blk.on_device:
            self.count_device(h, -1)
        return blk

    def count_device(self, h: int, delta: int) -> None:
        """Block ``h`` came to (+1) or left (-1) the device: tell the tables listing it."""
        for st in self.listers.get(h, ()):
            st.n_device += delta

    def charge_dropped(self, h: int, tokens_per_block: Mapping[str, int]) -> None:
        """Block ``h`` was dropped: charge its tokens to every session whose table lists it."""
        for st in self.listers.get(h, ()):
            st.dropped_tokens += tokens_per_block[st.model]

    # ------------------------------------------------------------------ tables
    def set_table(self, st: _SessionState, table: tuple[int, ...]) -> None:
        """Make ``table`` the session's table, keeping the lister index, device counts and
        orphans. Only what follows the common prefix of the two tables is touched.

        Blocks the old table leaves orphaned queue tail-first, so a prefix (which another
        session of the tenant may share, e.g. a system prompt) is evicted last.
        """
        blocks = self.blocks
        old = st.table
        same = 0
        for h_new, h_old in zip(table, old, strict=False):
            if h_new != h_old:
                break
            same += 1
        for h in table[same:]:
            listers = self.listers.get(h)
            if listers is None:
                self.listers[h] = [st]
                self.orphans.pop(h, None)
            else:
                listers.append(st)
            if (b := blocks.get(h)) and b.on_device:
                st.n_device += 1
        for h in reversed(old[same:]):
            listers = self.listers[h]
            listers.remove(st)
            if (b := blocks.get(h)) and b.on_device:
                st.n_device -= 1
            if not listers:
                del self.listers[h]
                if b:
                    self.orphans[h] = None
        st.table = table

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, refs: Mapping[int, int]) -> None:
        """Raise ``KVIntegrityError`` if the index disagrees with the tables.

        Device counts match the tables; the lister index matches the tables; orphans are
        exactly the live blocks no table lists; pins match the sessions' pinned hashes and
        name live blocks; references match ``refs`` (the calls' blocks); an uncomputed block
        is referenced.
        """
        tabs: dict[int, list[int]] = {}
        pins: dict[int, int] = {}
        for st in self.sessions.values():
            for h in st.table:
                tabs.setdefault(h, []).append(id(st))
            n_device = sum(1 for h in st.table if (b := self.blocks.get(h)) and b.on_device)
            expect_invariant(st.n_device == n_device, f"device count {st.n_device} != {n_device}")
            for h in st.pinned:
                pins[h] = pins.get(h, 0) + 1
        for h, blk in self.blocks.items():
            expect_invariant((h in self.orphans) == (h not in tabs), f"block {h}: orphan flag")
            expect_invariant(blk.pin == pins.get(h, 0), f"block {h}: pin {blk.pin}")
            expect_invariant(blk.ref == refs.get(h, 0), f"block {h}: ref {blk.ref}")
            expect_invariant(blk.computed or blk.ref > 0, f"block {h}: uncomputed, unreferenced")
        expect_invariant(
            {h: sorted(map(id, sts)) for h, sts in self.listers.items()}
            == {h: sorted(ids) for h, ids in tabs.items()},
            "table listers do not match the session tables",
        )
        expect_invariant(all(h in self.blocks for h in self.orphans), "a dead block is an orphan")
        for st in self.sessions.values():
            for h in st.pinned:
                expect_invariant(h in self.blocks, f"pinned block {h} is not live")
        idle = {k for k, st in self.sessions.items() if not st.running and not st.pinned}
        expect_invariant(idle == set(self.idle), "the idle sessions do not match the flags")
        expect_invariant(
            all(self.sessions[k] is st for k, st in self.idle.items()), "a stale idle session"
        )
