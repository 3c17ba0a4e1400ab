"""SWE-agent on Talaria: an agent hook that gives each run one session and reports its
tool gaps, with the model reached through the LiteLLM provider ``talaria/<model>``.

Written against SWE-agent 1.x's hook interface (``sweagent.agent.hooks.abstract.
AbstractAgentHook``: ``on_init``, ``on_run_start``, ``on_model_query``, ``on_action_started``,
``on_action_executed``, ``on_run_done``, ...), as ``DefaultAgent`` and ``RetryAgent`` call it.
The class is duck-typed and imports nothing from ``sweagent`` (SWE-agent 1.x is installed
from its repository, not PyPI), so it loads without SWE-agent and works with any agent
that calls these methods the same way.

Usage (Python; SWE-agent's YAML configs and ``sweagent run`` have no field for agent hooks,
and ``talaria/<model>`` resolves only where the provider is registered; a complete run is
:func:`talaria.integrations.swe_agent.sweagent_run.run_swe_agent`, checked against SWE-agent
1.1.0)::

    from talaria.integrations.swe_agent.sweagent_hook import (
        TalariaAgentHook,
        swe_agent_model_config,
    )
    from sweagent.run.run_single import RunSingle, RunSingleConfig

    config = RunSingleConfig.model_validate({
        "agent": {"model": swe_agent_model_config("smollm2-135m", "http://127.0.0.1:8000")},
        ...,
    })
    run = RunSingle.from_config(config)
    run.agent.add_hook(TalariaAgentHook())
    run.run()

What the hook does, per SWE-agent callback:

- ``on_init(agent)``: remembers the agent; registers the ``talaria`` LiteLLM provider if
  the model is ``talaria/...`` and the provider is not registered yet.
- ``on_run_start``: the previous run's session, if still open, ends.
- ``on_model_query``: a tool still running (its ``on_action_executed`` never came, e.g. a
  command timeout) ends; the run's session id (a new one on the run's first query) is put
  in the model's ``completion_kwargs["extra_headers"]["X-Session-ID"]``, which SWE-agent's
  ``LiteLLMModel`` passes to every ``litellm.completion`` (both ``talaria/`` and ``openai/``
  routes send it to the server).
- ``on_action_started(step)`` / ``on_action_executed(step)``: ``tool_start`` (tool
  ``bash``, the command ``step.action`` refining its kind, predicted seconds) and
  ``tool_end`` (measured span).
- ``on_run_done``: the session ends.

Hints go through the provider's hint sender for the model's ``api_base`` (one per server,
shared by all sessions of the process) and its shared gap predictor: queued, never blocking,
never raising. Nothing here changes what SWE-agent raises when the server fails: that is
LiteLLM's own exception, handled by SWE-agent's retry and autosubmission.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from talaria.integrations.swe_agent.runs import AgentSessions, SessionRecord

if TYPE_CHECKING:
    from talaria.integrations.litellm.provider import TalariaLLM

__all__ = ["SESSION_HEADER", "TalariaAgentHook", "swe_agent_model_config"]

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-ID"
PROVIDER_PREFIX = "talaria/"


class _Step(Protocol):
    """The part of SWE-agent's ``StepOutput`` the hook reads."""

    action: str


# Arguments SWE-agent 1.x's LiteLLMModel._single_query gives litellm.completion besides
# **completion_kwargs, and the model-config field that sets each.
_SWE_AGENT_COMPLETION_ARGS = {
    "model": "the model argument",
    "messages": "nothing: SWE-agent sends the history",
    "temperature": "the temperature field",
    "top_p": "the top_p field",
    "api_version": "the api_version field",
    "api_key": "the api_key field",
    "fallbacks": "the fallbacks field",
    "n": "nothing: SWE-agent sends n itself",
    "api_base": "the api_base argument",
    "tools": "the agent's tools config",
}


def swe_agent_model_config(
    model: str,
    api_base: str | None = "http://127.0.0.1:8000",
    *,
    max_input_tokens: int = 0,
    completion_kwargs: dict[str, Any] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """An SWE-agent ``agent.model`` config (``GenericAPIModelConfig`` fields) for a Talaria
    model through the LiteLLM provider: ``name`` ``talaria/<model>``, cost limits 0 (a
    self-hosted model has no price, and SWE-agent refuses unpriced models with limits set),
    ``max_input_tokens`` 0 (no client-side check: the server rejects a too-long prompt).
    ``api_base`` None serves from an embedded Talaria in the agent's process. Pure.

    ``completion_kwargs`` must not name an argument SWE-agent's ``LiteLLMModel`` passes to
    ``litellm.completion`` itself (``temperature``, ``top_p``, ``api_base``, ...): the call
    would fail with ``TypeError: got multiple values for keyword argument`` on every query;
    this raises ``ValueError`` naming the config field to use instead (``temperature=0.0``
    is a keyword of this function, like every other ``GenericAPIModelConfig`` field)."""
    clashes = sorted(set(completion_kwargs or {}) & set(_SWE_AGENT_COMPLETION_ARGS))
    if clashes:
        fields = ", ".join(f"{k!r} (use {_SWE_AGENT_COMPLETION_ARGS[k]})" for k in clashes)
        raise ValueError(
            f"completion_kwargs must not set {fields}: SWE-agent passes these to "
            "litellm.completion itself"
        )
    name = model if model.startswith(PROVIDER_PREFIX) else PROVIDER_PREFIX + model
    config: dict[str, Any] = {
        "name": name,
        "per_instance_cost_limit": 0.0,
        "total_cost_limit": 0.0,
        "max_input_tokens": max_input_tokens,
        "completion_kwargs": dict(completion_kwargs or {}),
    }
    if api_base is not None:
        config["api_base"] = api_base
    return config | overrides


def _api_key(model_config: Any) -> str | None:
    """The API key SWE-agent would send (``choose_api_key`` resolves ``$ENV`` and ``:::``)."""
    choose = getattr(model_config, "choose_api_key", None)
    try:
        key = choose() if callable(choose) else None
    except Exception:
        return None
    return key if isinstance(key, str) and key else None


class TalariaAgentHook:
    """An SWE-agent agent hook: one Talaria session per run, tool gaps as hints (see the
    module docstring). One hook per agent (as SWE-agent builds one agent per instance).

    ``sessions``: the session state to use; default: made at the first query, hints going
    to ``api_base`` (default: the agent model's ``api_base``; without one, the provider's
    embedded Talaria for a ``talaria/`` model, nowhere for another) through ``provider``'s
    sender. ``provider``: the ``TalariaLLM``
    handler to share senders and the gap predictor with (default: the module-level one,
    registered with LiteLLM when the model is ``talaria/...`` and ``register_provider``).
    ``session_id``: the first run's id (later runs add ``-2``, ``-3``, ...). ``tool``: the
    tool name sent with ``tool_start``.

    No method raises because of Talaria or the network.
    """

    def __init__(
        self,
        *,
        sessions: AgentSessions | None = None,
        provider: TalariaLLM | None = None,
        api_base: str | None = None,
        api_key: str | None = None,
        session_id: str | None = None,
        tool: str = "bash",
        register_provider: bool = True,
    ) -> None:
        self.sessions = sessions
        self.provider = provider
        self.api_base = api_base
        self.api_key = api_key
        self.session_id = session_id
        self.tool = tool
        self.register_provider = register_provider
        self._agent: Any = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ setup
    def _provider(self) -> TalariaLLM:
        if self.provider is None:
            from talaria.integrations.litellm import talaria_llm

            self.provider = talaria_llm
        return self.provider

    def _model_config(self) -> Any:
        return getattr(getattr(self._agent, "model", None), "config", None)

    def _ensure_sessions(self) -> AgentSessions:
        """The session state, made on first need from the agent's model config."""
        with self._lock:
            if self.sessions is not None:
                return self.sessions
            cfg = self._model_config()
            api_base = self.api_base or getattr(cfg, "api_base", None) or None
            api_key = self.api_key or _api_key(cfg)
            name = getattr(cfg, "name", "")
            provider = self._provider()
            # Without a server, hints can only go to the provider's embedded Talaria, and
            # only a talaria/ model uses it (never start one just for hints).
            embedded = isinstance(name, str) and name.startswith(PROVIDER_PREFIX)
            hints = provider.hint_sender(api_base, api_key) if api_base or embedded else None
            self.sessions = AgentSessions(
                hints=hints, predictor=provider.gap_predictor(), session_id=self.session_id
            )
            return self.sessions

    def _maybe_register(self) -> None:
        name = getattr(self._model_config(), "name", "")
        if not (self.register_provider and isinstance(name, str)):
            return
        if not name.startswith(PROVIDER_PREFIX):
            return
        import litellm

        prefix = PROVIDER_PREFIX.rstrip("/")
        if not any(e.get("provider") == prefix for e in litellm.custom_provider_map):
            from talaria.integrations.litellm import register

            register(self._provider(), prefix)

    def _set_header(self, session_id: str) -> None:
        """Put the session id in the model's ``completion_kwargs`` extra headers."""
        kwargs = getattr(self._model_config(), "completion_kwargs", None)
        if not isinstance(kwargs, dict):
            log.debug("talaria: the agent's model has no completion_kwargs; no session header")
            return
        headers = {
            k: v
            for k, v in dict(kwargs.get("extra_headers") or {}).items()
            if k.lower() != SESSION_HEADER.lower()
        }
        headers[SESSION_HEADER] = session_id
        kwargs["extra_headers"] = headers

    # ------------------------------------------------------------------ SWE-agent hooks
    def on_init(self, *, agent: Any) -> None:
        """``agent.add_hook(hook)`` (also each ``RetryAgent`` attempt's sub-agent)."""
        self._agent = agent
        try:
            self._maybe_register()
        except Exception:  # the model call will report a missing provider itself
            log.debug("talaria: provider registration failed", exc_info=True)

    def on_run_start(self) -> None:
        if self.sessions is not None:
            self.sessions.end_run()

    def on_model_query(self, *, messages: list[dict[str, Any]], agent: str) -> None:
        """Before each query (requeries included): close a dangling gap, tag the call."""
        try:
            sessions = self._ensure_sessions()
            sessions.end_tools()
            self._set_header(sessions.begin_call())
        except Exception:  # never fail the agent for a hint
            log.debug("talaria: could not tag the model call", exc_info=True)

    def on_action_started(self, *, step: _Step) -> None:
        if self.sessions is not None:
            action = getattr(step, "action", None)
            self.sessions.tool_started(self.tool, action if isinstance(action, str) else None)

    def on_action_executed(self, *, step: _Step) -> None:
        if self.sessions is not None:
            self.sessions.tool_ended(self.tool)

    def on_run_done(self, *, trajectory: Any, info: Any) -> None:
        self.end_session()

    def on_step_start(self) -> None: ...

    def on_actions_generated(self, *, step: _Step) -> None: ...

    def on_step_done(self, *, step: _Step, info: Any) -> None: ...

    def on_setup_attempt(self) -> None: ...

    def on_setup_done(self) -> None: ...

    def on_tools_installation_started(self) -> None: ...

    def on_query_message_added(self, **kwargs: Any) -> None: ...

    # ------------------------------------------------------------------ own API
    @property
    def current_session_id(self) -> str | None:
        return None if self.sessions is None else self.sessions.current_session_id

    def end_session(self) -> SessionRecord | None:
        """End the current run's session now (``on_run_done`` does; call it yourself when a
        run ends by an exception SWE-agent lets through, such as ``KeyboardInterrupt``)."""
        if self.sessions is None:
            return None
        self.sessions.end_tools()
        return self.sessions.end_run()

    def close(self, timeout_s: float = 1.0) -> None:
        """End the session and wait up to ``timeout_s`` seconds for queued hints (the
        provider's sender stays open for other sessions)."""
        self.end_session()
        if self.sessions is not None:
            self.sessions.flush(timeout_s)
