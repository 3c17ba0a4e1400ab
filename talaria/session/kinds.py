"""Tool kinds: what ran in a tool gap, from a tool name and (for shell tools) its command.

The kinds are the trace schema's five (:class:`~talaria.swebench_replay.traces.ToolKind`)
and shell commands are classified by the trace converter's own
:func:`~talaria.swebench_replay.convert.classify_command`, so a live client and a converted
trace agree on what a command is. ``talaria.swebench_replay.traces`` and
``talaria.swebench_replay.convert`` import only ``talaria.errors`` from the library, so
importing them here creates no cycle.

Tool *names* (function-calling agents: ``read_file``, ``run_tests``, ``pip_install``) are not
shell commands; :func:`classify_tool` reads their words with a small table of its own before
falling back to the command classifier.
"""

from __future__ import annotations

import re

from talaria.swebench_replay.convert import classify_command
from talaria.swebench_replay.traces import ToolKind

__all__ = ["OTHER_PREFIX", "ToolKind", "classify_command", "classify_tool", "gap_key"]

# A gap key for a tool that is not one of the four specific kinds: this prefix + the tool name.
OTHER_PREFIX = "other:"

_WORD_SPLIT = re.compile(r"[^a-z0-9]+")
# Checked in this order; the first kind with a matching word wins. Network tools come first
# so that "web_search" or "fetch_url" is not taken for a file search.
_NAME_WORDS: tuple[tuple[ToolKind, frozenset[str]], ...] = (
    (ToolKind.OTHER, frozenset({"web", "http", "https", "url", "browse", "browser", "fetch"})),
    (ToolKind.TESTS, frozenset({"test", "tests", "pytest", "unittest", "tox"})),
    (ToolKind.INSTALL, frozenset({"install", "pip", "conda", "apt"})),
    (ToolKind.PYTHON_SCRIPT, frozenset({"python", "py", "ipython", "jupyter", "notebook"})),
    (
        ToolKind.SHELL_READ_EDIT,
        frozenset(
            {
                *("read", "write", "edit", "view", "open", "list", "ls", "cat", "grep"),
                *("search", "find", "replace", "create", "insert", "file", "files", "dir"),
                *("directory", "glob", "patch", "str"),
            }
        ),
    ),
)
_KIND_VALUES = {k.value: k for k in ToolKind}


def _name_kind(tool: str) -> ToolKind:
    words = set(_WORD_SPLIT.split(tool.lower())) - {""}
    for kind, vocabulary in _NAME_WORDS:
        if words & vocabulary:
            return kind
    return ToolKind.OTHER


def classify_tool(tool: str, command: str | None = None) -> ToolKind:
    """The tool kind of one tool call (pure; never raises for any strings).

    - ``command`` given and not blank: the kind of that shell command
      (:func:`classify_command`; e.g. ``bash`` + ``"pytest -x"`` -> tests).
    - else ``tool`` is a kind's own name (``"tests"``): that kind.
    - else ``tool`` read as a command (``"pytest"``, ``"str_replace_editor"``), and if that says
      other, the words of the name (``"run_tests"`` -> tests, ``"read_file"`` ->
      shell_read_edit, ``"pip_install"`` -> install, ``"python_exec"`` -> python_script).
    """
    if command is not None and command.strip():
        return classify_command(command)
    known = _KIND_VALUES.get(tool)
    if known is not None:
        return known
    kind = classify_command(tool)
    return kind if kind is not ToolKind.OTHER else _name_kind(tool)


def gap_key(tool: str, command: str | None = None) -> str:
    """The key a gap predictor learns under: the kind's value (``"tests"``) for the four
    specific kinds; for anything classified other, ``"other:" + tool`` so that each unknown
    tool (``"other:web_search"``) learns its own gap. A tool named ``"other"`` keys as the
    kind ``"other"``."""
    kind = classify_tool(tool, command)
    if kind is not ToolKind.OTHER or tool == ToolKind.OTHER.value:
        return kind.value
    return OTHER_PREFIX + tool
