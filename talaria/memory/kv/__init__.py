"""KV block accounting for one instance: a device tier, a host tier and a prefix index.

Pure accounting: no torch, no I/O, no clock reads (callers pass ``now``). An executor executes
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

Layout: ``types`` (call keys, results, counters, the integrity error), ``blocks`` (the block
pool: free lists, loans, references and pins), ``prefix`` (prefix index and session tables),
``eviction`` (the ranking of cached blocks), ``manager`` (``KVManager``, composing them).
"""

from talaria.memory.kv.manager import KVManager
from talaria.memory.kv.types import Allocation, CallKey, MovePlan, PrefixMatch, SessionKV

__all__ = ["Allocation", "CallKey", "KVManager", "MovePlan", "PrefixMatch", "SessionKV"]
