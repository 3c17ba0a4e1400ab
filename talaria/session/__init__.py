"""Client-side session tracking: session ids, tool-gap prediction, hint events.

See docs/design.md "Wire format for sessions". One :class:`SessionTracker` per agent run; share
one :class:`GapPredictor` and one :class:`HintSender` across the trackers of a process.
"""

from talaria.session.gaps import MAX_EXPECTED_S, GapModelConfig, GapPredictor
from talaria.session.hints import MAX_TOOL_NAME_LEN, EventKind, HintCounters, HintEvent, HintStats
from talaria.session.ids import (
    MAX_SESSION_ID_LEN,
    SESSION_PREFIX,
    check_session_id,
    new_session_id,
    normalize_session_id,
    resolve_session_id,
    session_id_from_instance,
    session_id_from_langchain,
    session_id_from_litellm,
)
from talaria.session.kinds import ToolKind, classify_command, classify_tool, gap_key
from talaria.session.priors import KindPrior, ToolPriors, load_tool_priors
from talaria.session.sender import HintSender
from talaria.session.sinks import CallableSink, HintCallable, HintSink, HttpSink
from talaria.session.tracker import SessionTracker

__all__ = [
    "MAX_EXPECTED_S",
    "MAX_SESSION_ID_LEN",
    "MAX_TOOL_NAME_LEN",
    "SESSION_PREFIX",
    "CallableSink",
    "EventKind",
    "GapModelConfig",
    "GapPredictor",
    "HintCallable",
    "HintCounters",
    "HintEvent",
    "HintSender",
    "HintSink",
    "HintStats",
    "HttpSink",
    "KindPrior",
    "SessionTracker",
    "ToolKind",
    "ToolPriors",
    "check_session_id",
    "classify_command",
    "classify_tool",
    "gap_key",
    "load_tool_priors",
    "new_session_id",
    "normalize_session_id",
    "resolve_session_id",
    "session_id_from_instance",
    "session_id_from_langchain",
    "session_id_from_litellm",
]
