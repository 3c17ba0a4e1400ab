"""The calls one instance holds: a waiting queue per model, the running batch, and a bounded
record of recently finished calls.

``CallTable`` is bookkeeping, not policy: the instance core decides who moves where
(admission in :mod:`talaria.core.admitter`, completion in :mod:`talaria.core.instance`)
and moves calls only through the mutators here, which keep the totals the estimates read
(running calls and queued prompt tokens per model, prompt + answer tokens of every call
held) in step with the tables. ``changes`` counts the mutations, so estimates derived from
the table memoize on it instead of being cleared by hand; ``problems()`` recomputes every
total from the tables.

Not thread-safe: the instance core's single driver owns it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from talaria.memory.kv import CallKey
from talaria.schedule import Request

RECENT_FINISHED = 4096  # finished calls remembered for inspection (a server keeps no more)


class CallTable:
    """Waiting, running and recently finished calls of one instance, with their totals."""

    def __init__(self, models: Iterable[str], recent: int = RECENT_FINISHED) -> None:
        names = list(models)
        self.waiting: dict[str, collections.deque[Request]] = {
            m: collections.deque() for m in names
        }
        self.running: dict[CallKey, Request] = {}
        self.finished: collections.deque[Request] = collections.deque(maxlen=recent)
        self._running_of: dict[str, int] = dict.fromkeys(names, 0)
        self._queued_tokens: dict[str, int] = dict.fromkeys(names, 0)
        self._waiting_tenants: dict[str, collections.Counter[str]] = {
            m: collections.Counter() for m in names
        }
        self._held: collections.Counter[str] = collections.Counter()  # waiting + running
        self._load_tokens = 0
        self._changes = 0

    # ------------------------------------------------------------------ reads
    @property
    def changes(self) -> int:
        """Mutations so far: equal counts mean equal tables (a memo key)."""
        return self._changes

    @property
    def load_tokens(self) -> int:
        """Prompt + answer tokens of the calls queued or running."""
        return self._load_tokens

    def running_of(self, model: str) -> int:
        """Calls of ``model`` in the running batch."""
        return self._running_of[model]

    def queued_tokens(self, model: str) -> int:
        """Prompt tokens of ``model``'s waiting calls."""
        return self._queued_tokens[model]

    def tenants_waiting(self, model: str) -> int:
        """How many tenants have a call in ``model``'s queue."""
        return len(self._waiting_tenants[model])

    def held(self) -> Iterator[Request]:
        """Every call held: running, then waiting (by model, in queue order)."""
        yield from self.running.values()
        for queue in self.waiting.values():
            yield from queue

    def held_models(self) -> Iterable[str]:
        """The models with a call waiting or running (a view: do not mutate the table while
        iterating it)."""
        return self._held.keys()

    def held_of(self, model: str) -> int:
        """Calls of ``model`` waiting or running."""
        return self._held[model]

    @property
    def held_count(self) -> int:
        """Calls waiting or running, of every model."""
        return sum(self._held.values())

    def any_waiting(self, but: str | None = None) -> bool:
        """Whether a model other than ``but`` has a waiting call (only the models holding a
        call can)."""
        waiting = self.waiting
        return any(waiting[m] for m in self._held if m != but)

    # ------------------------------------------------------------------ mutations
    def enqueue(self, req: Request) -> None:
        """Queue ``req`` at the back of its model's queue."""
        self.waiting[req.call.model].append(req)
        self._queued_tokens[req.call.model] += req.prompt_len
        self._waiting_tenants[req.call.model][req.call.tenant] += 1
        self._load_tokens += req.prompt_len + req.target_output
        self._held[req.call.model] += 1
        self._changes += 1

    def pop_waiting(self, model: str) -> Request:
        """Take the head of ``model``'s queue for admission (``start`` runs it). Raises
        IndexError on an empty queue."""
        req = self.waiting[model].popleft()
        self._queued_tokens[model] -= req.prompt_len
        self._untenant(model, req.call.tenant)
        self._changes += 1
        return req

    def start(self, req: Request) -> None:
        """Add an admitted call to the running batch (after ``pop_waiting``)."""
        self.running[req.key] = req
        self._running_of[req.call.model] += 1
        self._changes += 1

    def finish(self, req: Request) -> None:
        """A running call is done: out of the batch, into the record of finished calls."""
        del self.running[req.key]
        self._running_of[req.call.model] -= 1
        self._load_tokens -= req.prompt_len + req.target_output
        self._unhold(req.call.model)
        self.finished.append(req)
        self._changes += 1

    def remove(self, key: CallKey) -> tuple[Request, bool] | None:
        """Drop the call ``key`` wherever it is, without recording it as finished. Returns
        it and whether it was running, or None if the table does not hold it."""
        req = self.running.pop(key, None)
        was_running = req is not None
        if req is not None:
            self._running_of[req.call.model] -= 1
        else:
            req = self._unqueue(key)
            if req is None:
                return None
            self._queued_tokens[req.call.model] -= req.prompt_len
            self._untenant(req.call.model, req.call.tenant)
        self._load_tokens -= req.prompt_len + req.target_output
        self._unhold(req.call.model)
        self._changes += 1
        return req, was_running

    def _unhold(self, model: str) -> None:
        held = self._held
        held[model] -= 1
        if not held[model]:
            del held[model]

    def _untenant(self, model: str, tenant: str) -> None:
        tenants = self._waiting_tenants[model]
        tenants[tenant] -= 1
        if not tenants[tenant]:
            del tenants[tenant]

    def _unqueue(self, key: CallKey) -> Request | None:
        for queue in self.waiting.values():
            for req in queue:
                if req.key == key:
                    queue.remove(req)
                    return req
        return None

    def reorder(self, model: str, key: Callable[[Request], Any]) -> None:
        """Sort ``model``'s queue by ``key`` (stable)."""
        self.replace_queue(model, sorted(self.waiting[model], key=key))

    def replace_queue(self, model: str, ordered: Sequence[Request]) -> None:
        """Put ``model``'s waiting calls in the order ``ordered`` (the same calls). Raises
        ValueError if ``ordered`` holds other calls; counts a change only if the order did."""
        queue = self.waiting[model]
        if len(ordered) != len(queue) or {id(r) for r in ordered} != {id(r) for r in queue}:
            raise ValueError(f"a new order of {model}'s queue must hold the same calls")
        if all(a is b for a, b in zip(queue, ordered, strict=True)):
            return
        queue.clear()
        queue.extend(ordered)
        self._changes += 1

    # ------------------------------------------------------------------ integrity
    def problems(self) -> list[str]:
        """Every total recomputed from the tables; a line for each that disagrees."""
        out = []
        for m, queue in self.waiting.items():
            running = sum(1 for r in self.running.values() if r.call.model == m)
            queued = sum(r.prompt_len for r in queue)
            if self._running_of[m] != running:
                out.append(f"{m}: {self._running_of[m]} running counted, {running} held")
            if self._queued_tokens[m] != queued:
                out.append(f"{m}: {self._queued_tokens[m]} queued tokens counted, {queued}")
            tenants = collections.Counter(r.call.tenant for r in queue)
            if self._waiting_tenants[m] != tenants:
                out.append(
                    f"{m}: waiting tenants {dict(self._waiting_tenants[m])} counted, "
                    f"{dict(tenants)} queued"
                )
        held = collections.Counter(r.call.model for r in self.held())
        if self._held != held:
            out.append(f"calls held per model {dict(self._held)} counted, {dict(held)} held")
        load = sum(r.prompt_len + r.target_output for r in self.held())
        if self._load_tokens != load:
            out.append(f"load {self._load_tokens} tokens counted, {load} held")
        return out
