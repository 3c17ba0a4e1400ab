"""The tune / test split of agent sessions: knobs are chosen on one part, claims made on the
other, and nothing is ever chosen on the test part.

A session's part is a pure function of its ``session_id`` (the task it solved): the first
eight bytes of the id's SHA-256 as an integer, modulo 3; remainder 0 is the *tune* part (a
third of the tasks), the rest the *test* part. So the split is fixed, needs no list, is the
same for every policy and every run, and keeps a task's sessions together (one task solved
by two models lands in one part). On the bundled traces: 43 sessions (38 tasks, 3,409 calls)
tune, 89 sessions (84 tasks, 7,013 calls) test. Traces a user brings are split by the same
rule, or replayed whole as a held-out test set (``Part.ALL``).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable

from talaria.swebench_replay.traces import TraceSession

PARTS = 3  # one tune part in three


class Part(enum.Enum):
    TUNE = "tune"
    TEST = "test"
    ALL = "all"


def part_of(session_id: str) -> Part:
    """``Part.TUNE`` or ``Part.TEST`` for a session (see the module docstring)."""
    digest = hashlib.sha256(session_id.encode()).digest()
    return Part.TUNE if int.from_bytes(digest[:8], "big") % PARTS == 0 else Part.TEST


def select_part(sessions: Iterable[TraceSession], part: Part) -> list[TraceSession]:
    """The sessions of ``part`` (all of them for ``Part.ALL``), in their input order."""
    if part is Part.ALL:
        return list(sessions)
    return [s for s in sessions if part_of(s.session_id) is part]
