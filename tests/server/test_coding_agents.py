"""Claude Code, Codex CLI and OpenCode, the real npm packages, against ``talaria serve``
with no change on their side (marker ``clients``; ``.ci/run`` runs it).

Each runs non-interactively in a scratch directory through
``examples/coding_agents/run_client.sh`` against a scripted ``agent-tiny-dummy`` (random
weights, a 32K context; ``tests.server.coding_agents``): its first answer is a call of the
client's read-only tool on a file there, its next the sentence the test expects. Per
client: it exits 0 with the answer printed; the server saw one session, under the client's
own id; the follow-up after the tool round trip found at least 90% of its prompt cached;
the gap was learned under the key the server derives from the tool's name
(``talaria.session.kinds.gap_key``: a read tool's kind, ``shell_read_edit``). The figures
are printed (``pytest -rP``).
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from talaria.session.kinds import gap_key
from tests.server.coding_agents import (
    ANSWER,
    FILE,
    READ_TOOLS,
    install_clients,
    run_client,
    scripted_server,
)

pytestmark = pytest.mark.clients

# how each client's session id looks, and where the test learns it
_CODEX_ID = re.compile(r"session id: ([0-9a-f-]{36})")
_OPENCODE_ID = re.compile(r"\Ases_[0-9A-Za-z]+\Z")


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    return install_clients()


def _client_args(client: str) -> tuple[list[str], str | None]:
    """Extra arguments for the client, and the session id it will use when the test picks
    it (Claude Code takes one with --session-id)."""
    if client == "claude":
        sid = str(uuid.uuid4())
        return ["--session-id", sid], sid
    return [], None


@pytest.mark.parametrize("client", ["claude", "codex", "opencode"])
def test_client_round_trip(client: str, bin_dir: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / FILE).write_text("hello from the coding-agent test\n")
    args, sid = _client_args(client)
    with scripted_server(work) as (url, talaria, log):
        out = run_client(client, bin_dir, url, work, *args)
        gaps = talaria.stats()["tool_gaps"]
    assert ANSWER in out, out[-4000:]
    sessions = {line.session for line in log.lines}
    assert len(sessions) == 1, sessions
    (seen,) = sessions
    if client == "claude":
        assert seen == sid
    elif client == "codex":
        match = _CODEX_ID.search(out)
        assert match is not None and seen == match.group(1), (seen, out[:2000])
    else:
        assert _OPENCODE_ID.match(seen), seen
    tool = READ_TOOLS[client][0]
    follow = log.lines[-1]  # the answer after the tool's result
    assert len(log.lines) >= 2 and follow.call >= 1, log.lines
    share = follow.cached / follow.prompt
    key = gap_key(tool)
    learned = gaps.get(key)
    print(
        f"{client}: {len(log.lines)} calls in session {seen}; the follow-up's prompt "
        f"{follow.prompt} tokens, {follow.cached} cached ({share:.1%}); the gap after "
        f"{tool!r} learned under {key!r}: {learned}"
    )
    assert share >= 0.9, log.lines
    assert learned is not None and learned["observations"] >= 1, gaps
