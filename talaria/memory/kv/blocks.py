"""The block pool of one instance: the ids of the device and host tiers, their free lists,
loans of free device blocks, and the references and pins that hold a device block.

A ``_Block`` is one hashed block (the prefix index, :mod:`.prefix`, names it by content hash);
private blocks (a call's partial tail, output, shadow copies) are bare ids the manager keeps.
``BlockPool`` hands out and takes back ids and keeps the *held* count (device blocks that
eviction may not take). It knows no hashes, sessions or eviction order; the manager
(:mod:`.manager`) composes it with the index and the ranking (:mod:`.eviction`).

Each tier hands out its lowest free id first; ids freed later go out again last-freed-first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from talaria.errors import OutOfBlocks
from talaria.memory.kv.types import expect_invariant


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


class BlockPool:
    """Block ids of a device tier and a host tier, and what holds the device ones.

    A device id is free, lent, private to a call, or owned by a hashed block; a host id is
    free or owned by a hashed block. ``held`` counts the device blocks eviction may not take:
    every private block and every hashed device block with a reference or a pin.
    """

    def __init__(self, device_blocks: int, host_blocks: int) -> None:
        self.device_blocks = device_blocks
        self.host_blocks = host_blocks
        self.device_free_ids: list[int] = list(range(device_blocks - 1, -1, -1))
        self.host_free_ids: list[int] = list(range(host_blocks - 1, -1, -1))
        self.lent: list[int] = []  # free device blocks lent out (weight staging)
        self.held = 0  # device blocks (hashed or private) that may not be evicted

    # ------------------------------------------------------------------ queries
    @property
    def device_free(self) -> int:
        return len(self.device_free_ids)

    @property
    def host_free(self) -> int:
        return len(self.host_free_ids)

    @property
    def device_evictable(self) -> int:
        """Device blocks that eviction may take (cached, unpinned, unreferenced)."""
        return self.device_blocks - len(self.device_free_ids) - self.held - len(self.lent)

    # ------------------------------------------------------------------ private blocks
    def take_device(self) -> int:
        """A free device id. The caller counts it held (``hold``) or gives it to a block."""
        if not self.device_free_ids:
            raise OutOfBlocks("no free device block (eviction was not planned)")
        return self.device_free_ids.pop()

    def hold(self, n: int) -> None:
        """``n`` device ids just taken stay private to a call (held until freed)."""
        self.held += n

    def free_private(self, bid: int) -> None:
        self.held -= 1
        self.device_free_ids.append(bid)

    def adopt(self, blk: _Block, now: float) -> None:
        """A private block became hashed ``blk``: it stays held, now by a reference."""
        self.held -= 1  # it leaves the private set; ref counts it again
        self.ref(blk, now)

    # ------------------------------------------------------------------ holds
    def ref(self, blk: _Block, now: float) -> None:
        if blk.on_device and blk.ref == 0 and blk.pin == 0:
            self.held += 1
        blk.ref += 1
        blk.last_used = now

    def unref(self, blk: _Block) -> None:
        blk.ref -= 1
        if blk.on_device and blk.ref == 0 and blk.pin == 0:
            self.held -= 1

    def pin(self, blk: _Block) -> None:
        if blk.on_device and blk.ref == 0 and blk.pin == 0:
            self.held += 1
        blk.pin += 1

    def unpin(self, blk: _Block) -> None:
        blk.pin -= 1
        if blk.on_device and blk.ref == 0 and blk.pin == 0:
            self.held -= 1

    # ------------------------------------------------------------------ moves
    def to_device(self, blk: _Block) -> tuple[int, int]:
        """Move a host block to a free device id; returns (host id, device id)."""
        dst = self.take_device()
        move = (blk.bid, dst)
        self.host_free_ids.append(blk.bid)
        blk.bid = dst
        blk.on_device = True
        if blk.ref or blk.pin:
            self.held += 1
        return move

    def to_host(self, blk: _Block) -> tuple[int, int]:
        """Move one unheld device block to a free host id; returns (device id, host id)."""
        src = blk.bid
        self.device_free_ids.append(src)
        blk.bid = self.host_free_ids.pop()
        blk.on_device = False
        return (src, blk.bid)

    def release(self, blk: _Block) -> None:
        """Free the id of an unheld block that is forgotten (dropped or never computed)."""
        if blk.on_device:
            self.device_free_ids.append(blk.bid)
        else:
            self.host_free_ids.append(blk.bid)

    # ------------------------------------------------------------------ loans
    def lend(self, n: int) -> tuple[int, ...]:
        """Lend ``n`` free device blocks (nothing is evicted for a loan), e.g. as a staging
        area for the next model's weights. Raises ``OutOfBlocks`` if fewer are free."""
        if n < 0 or n > len(self.device_free_ids):
            raise OutOfBlocks(f"cannot lend {n} blocks: {len(self.device_free_ids)} are free")
        ids = self.device_free_ids[len(self.device_free_ids) - n :]
        del self.device_free_ids[len(self.device_free_ids) - n :]
        ids.reverse()  # the same blocks, in the order single pops would take them
        self.lent.extend(ids)
        return tuple(ids)

    def return_lent(self) -> int:
        """Take back every lent block; returns how many."""
        n = len(self.lent)
        self.device_free_ids.extend(reversed(self.lent))
        self.lent.clear()
        return n

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, blocks: Iterable[_Block], private: Sequence[int]) -> None:
        """Raise ``KVIntegrityError`` unless every id of each tier is owned exactly once and
        the held count is right, given the hashed ``blocks`` and the calls' ``private`` ids.

        Device: free + lent + private + hashed-on-device == total. Host: free +
        hashed-on-host == total. Held: private + hashed device blocks referenced or pinned.
        """
        dev_owned: list[int] = list(self.device_free_ids) + self.lent
        host_owned: list[int] = list(self.host_free_ids)
        dev_owned.extend(private)
        held = len(private)
        for blk in blocks:
            (dev_owned if blk.on_device else host_owned).append(blk.bid)
            held += blk.on_device and (blk.ref > 0 or blk.pin > 0)
        _check_ids(dev_owned, self.device_blocks, "device")
        _check_ids(host_owned, self.host_blocks, "host")
        expect_invariant(held == self.held, f"held {held} != counter {self.held}")


def _check_ids(owned: list[int], total: int, tier: str) -> None:
    expect_invariant(len(owned) == total, f"{tier}: {len(owned)} blocks accounted of {total}")
    expect_invariant(len(set(owned)) == len(owned), f"{tier}: a block is owned twice")
    expect_invariant(all(0 <= b < total for b in owned), f"{tier}: block id out of range")
