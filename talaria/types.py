"""Plain data shared by policy, memory, executors and clients.

Nothing here does I/O or imports torch. ``TokenSeq`` is the one class with behaviour: an
immutable token sequence built by extension (each call's prompt is the previous prompt plus
the previous output plus new tokens) that caches its chained block hashes, so hashing a
session's history costs the new tokens only.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Iterable
from typing import NamedTuple, TypedDict

import attrs

from talaria.errors import BadRequest

SessionId = str  # a client's name for its session (unique within its tenant)
DEFAULT_TENANT = "default"


class SessionKey(NamedTuple):
    """A session as the core keys it: its tenant and the tenant's id for it. Tenants never
    share a session (their calls never reuse each other's KV, their hints reach only their
    own sessions), whatever ids they pick."""

    tenant: str
    id: SessionId  # what errors name: a caller only ever sees its own tenant's sessions


class Residency(enum.Enum):
    """Where a model's weights are on one instance (docs/design.md vocabulary)."""

    ACTIVE = "active"
    RESIDENT = "resident"
    STAGED = "staged"
    HOST = "host"
    COLD = "cold"


class Link(enum.Enum):
    """A copy path; the cost model prices bytes moved over each."""

    DISK_TO_HOST = "disk->host"
    HOST_TO_DEVICE = "host->device"
    DEVICE_TO_HOST = "device->host"
    DEVICE_TO_DEVICE = "device->device"


class KVTier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    GONE = "gone"


def salt_for(tenant: str, model: str) -> int:
    """Hash-chain seed for one (tenant, model): tenants never share cached blocks.

    Uses crc32 rather than ``hash(str)`` so values are the same in every process.
    """
    return zlib.crc32(f"{tenant}\x00{model}".encode()) | (1 << 40)


class TokenSeq:
    """An immutable sequence of token ids, built by extending a parent.

    ``block_hashes(block_size, salt)`` returns the chained hashes of the full blocks; the
    result is cached per ``(block_size, salt)`` and a child reuses its parent's hashes, so a
    session whose prompts grow by a few hundred tokens per call hashes each token once.
    Hashes are Python tuple hashes of ints: deterministic across processes.
    """

    __slots__ = ("_hashes", "_len", "_parent", "_suffix")

    def __init__(self, tokens: Iterable[int] = (), parent: TokenSeq | None = None) -> None:
        suffix = tuple(tokens)
        for t in suffix:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise BadRequest(f"token ids must be non-negative integers, got {t!r}")
        self._parent = parent
        self._suffix = suffix
        self._len = (len(parent) if parent is not None else 0) + len(suffix)
        self._hashes: dict[tuple[int, int], tuple[int, ...]] = {}

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"TokenSeq(len={self._len})"

    def extend(self, tokens: Iterable[int]) -> TokenSeq:
        """A new sequence: this one followed by ``tokens`` (this one is unchanged)."""
        return TokenSeq(tokens, parent=self)

    def tokens(self) -> tuple[int, ...]:
        """All token ids (materialized; O(len))."""
        parts: list[tuple[int, ...]] = []
        node: TokenSeq | None = self
        while node is not None:
            parts.append(node._suffix)
            node = node._parent
        out: list[int] = []
        for part in reversed(parts):
            out.extend(part)
        return tuple(out)

    def tail(self, n: int) -> tuple[int, ...]:
        """The last ``n`` token ids (walks back only as far as needed)."""
        parts: list[tuple[int, ...]] = []
        need = min(n, self._len)
        node: TokenSeq | None = self
        while need > 0 and node is not None:
            take = node._suffix[max(0, len(node._suffix) - need) :]
            parts.append(take)
            need -= len(take)
            node = node._parent
        out: list[int] = []
        for part in reversed(parts):
            out.extend(part)
        return tuple(out)

    def block_hashes(self, block_size: int, salt: int) -> tuple[int, ...]:
        """Chained hashes of the ``len // block_size`` full blocks, seeded with ``salt``."""
        key = (block_size, salt)
        cached = self._hashes.get(key)
        if cached is not None:
            return cached
        base = self._parent.block_hashes(block_size, salt) if self._parent is not None else ()
        n_full = self._len // block_size
        if n_full == len(base):
            result = base
        else:
            start = len(base) * block_size
            fresh = self.tail(self._len - start)
            hashes = list(base)
            prev = hashes[-1] if hashes else salt
            for i in range(len(base), n_full):
                lo = (i - len(base)) * block_size
                prev = hash((prev, fresh[lo : lo + block_size]))
                hashes.append(prev)
            result = tuple(hashes)
        self._hashes[key] = result
        return result


@attrs.frozen
class Call:
    """One LLM request of a session.

    ``prompt`` is the whole history sent with this call. ``max_new_tokens`` bounds the
    answer; ``output_tokens`` is the known answer length when replaying a trace (the
    simulator uses it; a live engine stops at end-of-sequence or ``max_new_tokens``).
    ``arrival_s`` is when the call was sent, on the runtime's clock.
    """

    session_id: SessionId
    index: int
    model: str
    prompt: TokenSeq = attrs.field(eq=False)
    max_new_tokens: int
    output_tokens: int | None = None
    tenant: str = DEFAULT_TENANT
    arrival_s: float = 0.0
    session: SessionKey = attrs.field(init=False, eq=False)  # (tenant, session_id)

    def __attrs_post_init__(self) -> None:
        if not self.session_id:
            raise BadRequest("a call needs a session id")
        object.__setattr__(self, "session", SessionKey(self.tenant, self.session_id))
        if self.max_new_tokens <= 0:
            raise BadRequest(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if len(self.prompt) == 0:
            raise BadRequest("the prompt is empty")
        if self.output_tokens is not None and not 0 < self.output_tokens <= self.max_new_tokens:
            raise BadRequest(
                f"output_tokens must be in 1..max_new_tokens ({self.max_new_tokens}), "
                f"got {self.output_tokens}"
            )

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def key(self) -> tuple[SessionKey, int]:
        return (self.session, self.index)


@attrs.frozen
class ToolHint:
    """What a client says about the gap after a call: a tool started, back in ``expected_s``."""

    session_id: SessionId
    tool: str = "unknown"
    expected_s: float | None = None
    at_s: float = 0.0


class EventKind(enum.Enum):
    TOOL_START = "tool_start"
    TOOL_END = "tool_end"
    END = "end"


class HintFields(TypedDict, total=False):
    """A hint's fields besides its session and event, as keywords (absent ones omitted):
    the tool that started, the seconds the client expects it to take, the seconds it took."""

    tool: str | None
    expected_s: float | None
    measured_s: float | None


@attrs.frozen
class SessionEvent:
    """A hint event of docs/design.md's wire format, in process."""

    session_id: SessionId
    kind: EventKind
    tool: str | None = None
    expected_s: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.expected_s is not None and not 0 <= self.expected_s < 86400:
            raise BadRequest(f"expected_s must be in [0, 86400), got {self.expected_s}")


@attrs.frozen
class ScriptedCall:
    """One call of a scripted session (a replay): what is sent and what follows it.

    ``history`` is ``prompt`` followed by the answer's token ids (the next call's prompt
    starts with it). ``tool_seconds`` is the tool gap after the answer; ``hint_s`` is what
    the client tells the server about that gap (None: no hint).
    """

    prompt: TokenSeq = attrs.field(eq=False)
    history: TokenSeq = attrs.field(eq=False)
    output_tokens: int
    max_new_tokens: int
    tool_seconds: float = 0.0
    tool_kind: str = "other"
    hint_s: float | None = None


@attrs.frozen
class ToolRun:
    """What a scripted client does between two calls: the hint it sends when the tool starts
    (``hint_s`` None: none) and how long the tool runs."""

    seconds: float
    hint_s: float | None
    tool: str


@attrs.frozen
class SessionScript:
    """A session as a request source: start time, model, and its calls in order.

    The one playback rule, shared by the simulator and the live replay: call ``i`` arrives
    (``call``); once it is answered the client either ends the session (``after`` is None)
    or runs a tool (``after``), sending its hint when the tool starts, and call ``i + 1``
    arrives when the tool is done."""

    session_id: SessionId
    model: str
    start_s: float
    calls: tuple[ScriptedCall, ...]
    tenant: str = DEFAULT_TENANT

    @property
    def key(self) -> SessionKey:
        return SessionKey(self.tenant, self.session_id)

    def call(self, index: int, now: float) -> Call:
        """Call ``index`` as it arrives at ``now``."""
        sc = self.calls[index]
        return Call(
            self.session_id,
            index,
            self.model,
            sc.prompt,
            sc.max_new_tokens,
            sc.output_tokens,
            self.tenant,
            now,
        )

    def after(self, index: int) -> ToolRun | None:
        """What follows call ``index``'s answer: None after the last call (the session
        ends), else the tool run before the next call (a client that sends hints names the
        tool too)."""
        if index + 1 >= len(self.calls):
            return None
        sc = self.calls[index]
        return ToolRun(sc.tool_seconds, sc.hint_s, sc.tool_kind)
