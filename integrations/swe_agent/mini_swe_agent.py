"""mini-swe-agent on Talaria: a model class, an environment wrapper and an agent class.

Supports mini-swe-agent 2.x (written and tested against 2.4.6, whose ``Model`` protocol is
``config``, ``query``, ``format_message``, ``format_observation_messages``,
``get_template_vars`` and ``serialize``). Importing this module imports ``minisweagent``.

- :class:`TalariaModel` calls a Talaria server (OpenAI-compatible, ``base_url``) through
  LiteLLM's ``openai/`` route, exactly like mini-swe-agent's own
  ``LitellmTextbasedModel`` (Talaria returns tool calls as text, so actions are parsed from
  fenced blocks): same retries, same exceptions, same message format. Each call carries its
  agent run's session id in ``X-Session-ID``; usage, cached tokens and cost land in each
  message's ``extra``. Plug it in by config (``model_class`` is an import path)::

      model:
        model_class: talaria.integrations.swe_agent.mini_swe_agent.TalariaModel
        model_name: smollm2-135m
        base_url: http://127.0.0.1:8000

- :class:`TalariaEnvironment` wraps any mini-swe-agent environment: each ``execute`` is
  reported as a tool gap (``tool_start`` with the predicted seconds, ``tool_end`` with the
  measured span), and ``Submitted`` ends the session.
- :class:`TalariaAgent` (or :class:`TalariaAgentMixin` on any agent class) wraps the
  environment automatically and ends the session when ``run`` returns or raises, whatever
  the exit (``Submitted``, ``LimitsExceeded``, ``RepeatedFormatError``, an exception).

Without the wrapper (e.g. mini-swe-agent's SWE-bench runner, which builds its own agent),
the model reports the gaps itself: ``tool_start`` when it returns actions, ``tool_end`` when
the next call begins; the session ends with :meth:`TalariaModel.close`, when the model is
garbage collected, or when a call starts a new conversation. Hints never block or raise;
a server that is down costs the agent nothing beyond the failed LLM call itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import litellm
from minisweagent import Environment
from minisweagent.agents.default import DefaultAgent
from minisweagent.exceptions import Submitted
from minisweagent.models.litellm_model import LitellmModel
from minisweagent.models.litellm_textbased_model import LitellmTextbasedModelConfig
from minisweagent.models.utils.actions_text import (
    format_observation_messages,
    parse_regex_actions,
)
from pydantic import Field, SecretStr, field_validator

from talaria.integrations.swe_agent.runs import DEFAULT_BASE_URL, AgentSessions, SessionRecord
from talaria.session import GapPredictor, HintSender

__all__ = [
    "LENIENT_ACTION_REGEX",
    "SMALL_MODEL_ACTION_REGEX",
    "TalariaAgent",
    "TalariaAgentMixin",
    "TalariaEnvironment",
    "TalariaModel",
    "TalariaModelConfig",
]

log = logging.getLogger(__name__)

# Accepts ```mswea_bash_command, ```bash, ```sh and bare ``` fences: small models rarely
# keep mini-swe-agent's own fence name. Exactly one block is still required.
LENIENT_ACTION_REGEX = r"```(?:mswea_bash_command|bash|sh)?[ \t]*\n(.*?)\n```"
# For very small models (SmolLM2-135M): the first fenced block is the action, whatever
# follows it, and a block cut off by max_tokens still counts (the regex matches at most once).
SMALL_MODEL_ACTION_REGEX = r"\A.*?```(?:mswea_bash_command|bash|sh)?[ \t]*\n(.*?)(?:\n```|\Z)"
SESSION_HEADER = "X-Session-ID"
INSTANCE_HEADER = "llm_provider-x-talaria-instance"  # LiteLLM's name for X-Talaria-Instance


def _env_base_url() -> str:
    return os.getenv("TALARIA_BASE_URL", DEFAULT_BASE_URL)


def _env_api_key() -> SecretStr | None:
    key = os.getenv("TALARIA_API_KEY")
    return SecretStr(key) if key else None


class TalariaModelConfig(LitellmTextbasedModelConfig):
    """:class:`TalariaModel`'s settings (all of ``LitellmTextbasedModelConfig``'s, plus the
    ones below). Units: seconds, cost units per token."""

    base_url: str = Field(default_factory=_env_base_url)
    """The Talaria server, ``http://host:port`` (a trailing ``/v1`` is accepted). Default:
    ``$TALARIA_BASE_URL`` or ``http://127.0.0.1:8000``."""
    api_key: SecretStr | None = Field(default_factory=_env_api_key)
    """Sent as ``Authorization: Bearer``; default ``$TALARIA_API_KEY``. Masked in
    trajectories and template variables."""
    session_id: str | None = None
    """The first run's session id (e.g. a SWE-bench instance id); later runs append
    ``-2``, ``-3``, ... Default: a fresh ``sess-<uuid>`` per run."""
    timeout_s: float = Field(default=600.0, gt=0)
    """LiteLLM's request timeout for one attempt; a slower answer raises
    ``litellm.exceptions.Timeout`` (retried like any other by mini-swe-agent)."""
    tool_hints: bool = True
    """Send tool-gap hints. With a :class:`TalariaEnvironment` the environment measures
    the gaps; without one the model infers them from its own calls."""
    hint_timeout_s: float = Field(default=0.5, gt=0, le=60)
    """Per-event HTTP timeout of the background hint sender."""
    input_cost_per_token: float = Field(default=0.0, ge=0)
    output_cost_per_token: float = Field(default=0.0, ge=0)
    """Cost reported per prompt / completion token (self-hosted models are free: 0)."""

    @field_validator("base_url")
    @classmethod
    def _strip_url(cls, value: str) -> str:
        text = value.strip().rstrip("/")
        if not text.startswith(("http://", "https://")):
            raise ValueError(f"base_url must look like http://host:port, got {value!r}")
        return text.removesuffix("/v1")

    @property
    def served_model(self) -> str:
        """The model name the server knows (``talaria/`` and ``openai/`` prefixes dropped)."""
        name = self.model_name
        for prefix in ("talaria/", "openai/"):
            name = name.removeprefix(prefix)
        return name


def _conversation_key(messages: Sequence[Mapping[str, Any]]) -> str:
    """A digest of a conversation's first two messages (system prompt and task)."""
    head = [(m.get("role"), m.get("content")) for m in messages[:2]]
    return hashlib.sha256(json.dumps(head, default=str).encode()).hexdigest()


def _usage_numbers(response: Any) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of a LiteLLM response; zeros when absent."""
    usage = getattr(response, "usage", None)
    prompt = int(getattr(usage, "prompt_tokens", 0) or 0)
    completion = int(getattr(usage, "completion_tokens", 0) or 0)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = int(getattr(details, "cached_tokens", 0) or 0)
    return prompt, completion, cached


class TalariaModel(LitellmModel):
    """A mini-swe-agent model served by Talaria (see the module docstring).

    ``sessions``: the session state to use (default: a new :class:`AgentSessions` posting
    hints to ``config.base_url``, owned and closed by this model). ``predictor``: a gap
    predictor to share across models (default: a fresh one from the packaged priors).
    Other keyword arguments are :class:`TalariaModelConfig` fields.

    One model serves one agent at a time (mini-swe-agent builds one model per agent). A
    new run starts a new session: after :meth:`end_session` (``TalariaAgent`` calls it),
    or when a call's conversation does not continue the previous call's: different first
    two messages, or no more messages than before (mini-swe-agent's agents add at least one
    message between two calls of a run).
    """

    config: TalariaModelConfig

    def __init__(
        self,
        *,
        sessions: AgentSessions | None = None,
        predictor: GapPredictor | None = None,
        **kwargs: Any,
    ) -> None:
        LitellmModel.__init__(self, config_class=TalariaModelConfig, **kwargs)
        cfg = self.config
        if sessions is None:
            key = cfg.api_key.get_secret_value() if cfg.api_key is not None else None
            sessions = AgentSessions(
                hints=HintSender.http(cfg.base_url, api_key=key, timeout_s=cfg.hint_timeout_s)
                if cfg.tool_hints
                else None,
                predictor=predictor or GapPredictor.default(),
                session_id=cfg.session_id,
                own_hints=True,
            )
        self.sessions = sessions
        self._environment_reports = False
        self._last_key: str | None = None
        self._last_len = 0
        # Ends the open session (and stops an owned sender) when the model is collected
        # or the interpreter exits; AgentSessions holds no reference back to the model.
        self._finalizer = weakref.finalize(self, sessions.close)

    # ------------------------------------------------------------------ sessions
    @property
    def session_id(self) -> str | None:
        """The open session's id (``None`` before the first call of a run)."""
        return self.sessions.current_session_id

    def attach_environment(self) -> None:
        """An environment wrapper reports this model's tool gaps from now on; the model
        stops inferring them from its calls."""
        self._environment_reports = True

    def end_session(self) -> SessionRecord | None:
        """End the current run's session (``end`` is sent if it made a call); the next call
        opens a new one. Returns the ended session's record."""
        self._last_key = None
        self._last_len = 0
        return self.sessions.end_run()

    def close(self, timeout_s: float = 1.0) -> None:
        """End the session and stop the hint sender if this model owns it, delivering queued
        hints for up to ``timeout_s`` seconds. Idempotent."""
        self.end_session()
        self.sessions.close(timeout_s)
        self._finalizer.detach()

    def __enter__(self) -> TalariaModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls
    def query(self, messages: list[dict[str, str]], **kwargs: Any) -> dict[str, Any]:
        """mini-swe-agent's ``query``: one LLM call in the run's session. Raises what
        ``LitellmTextbasedModel.query`` raises (``FormatError`` carrying the cost and usage,
        LiteLLM's exceptions after mini-swe-agent's retries)."""
        self._start_call(messages)
        headers = {
            **dict(self.config.model_kwargs.get("extra_headers") or {}),
            **dict(kwargs.pop("extra_headers", None) or {}),
        }
        # The session is chosen once per query, so retries stay in the same session.
        headers[SESSION_HEADER] = self.sessions.begin_call()
        message: dict[str, Any] = super().query(messages, extra_headers=headers, **kwargs)
        if self.config.tool_hints and not self._environment_reports:
            for action in message.get("extra", {}).get("actions", []):
                self.sessions.tool_started("bash", action.get("command"))
        return message

    def _start_call(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Close the gap the model opened after its previous call, and start a new run if
        this conversation does not continue the previous one."""
        self.sessions.end_tools()
        key = _conversation_key(messages)
        if self._last_key is not None and (
            key != self._last_key or len(messages) <= self._last_len
        ):
            self.sessions.end_run()
        self._last_key, self._last_len = key, len(messages)

    def _query(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        cfg = self.config
        params: dict[str, Any] = {
            "api_base": f"{cfg.base_url}/v1",
            # The OpenAI client insists on a key; a server without keys ignores it.
            "api_key": cfg.api_key.get_secret_value() if cfg.api_key is not None else "talaria",
            "timeout": cfg.timeout_s,
        }
        try:
            return litellm.completion(
                model=f"openai/{cfg.served_model}",
                messages=messages,
                **(params | cfg.model_kwargs | kwargs),
            )
        except litellm.exceptions.AuthenticationError as e:
            e.message += " Set the Talaria API key with api_key or $TALARIA_API_KEY."
            raise

    def _parse_actions(self, response: Any) -> list[dict[str, Any]]:
        """Actions from fenced blocks (``config.action_regex``), as the text-based model."""
        content = response.choices[0].message.content or ""
        actions: list[dict[str, Any]] = parse_regex_actions(
            content,
            action_regex=self.config.action_regex,
            format_error_template=self.config.format_error_template,
            template_kwargs={"finish_reason": response.choices[0].finish_reason},
        )
        return actions

    def _calculate_cost(self, response: Any) -> dict[str, Any]:
        """Cost from the token prices (never raises), plus the call's Talaria usage under
        ``"talaria"``: it lands in the message's ``extra`` (also on ``FormatError``)."""
        prompt, completion, cached = _usage_numbers(response)
        self.sessions.record_usage(prompt, completion, cached)
        cost = prompt * self.config.input_cost_per_token
        cost += completion * self.config.output_cost_per_token
        hidden = getattr(response, "_hidden_params", None) or {}
        headers = hidden.get("additional_headers") or {}
        return {
            "cost": cost,
            "talaria": {
                "session_id": self.session_id,
                "instance": headers.get(INSTANCE_HEADER),
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "cached_tokens": cached,
            },
        }

    def format_observation_messages(
        self,
        message: dict[str, Any],
        outputs: list[dict[str, Any]],
        template_vars: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Observations as user messages (the text-based model's format)."""
        observations: list[dict[str, Any]] = format_observation_messages(
            outputs,
            observation_template=self.config.observation_template,
            template_vars=template_vars,
            multimodal_regex=self.config.multimodal_regex,
        )
        return observations

    def serialize(self) -> dict[str, Any]:
        """The parent's trajectory info plus ``info.talaria``: session ids, per-session
        calls and tokens, hint delivery counts."""
        data: dict[str, Any] = super().serialize()
        data["info"]["talaria"] = self.sessions.summary()
        return data


class TalariaEnvironment:
    """Wraps a mini-swe-agent environment; each ``execute`` is one tool gap of the run's
    session (``tool_start`` with the predicted seconds before, ``tool_end`` with the
    measured span after, even when the command raises).

    ``session``: the :class:`TalariaModel` of the agent (it stops inferring gaps itself) or
    an :class:`AgentSessions`. ``tool``: the tool name sent; the command refines its kind
    (``pytest`` -> tests). ``end_on_submit``: end the session when the command submits
    (``Submitted``); turn it off for an agent that may continue after a submission
    (``InteractiveAgent`` with ``confirm_exit``). Other attributes are the wrapped
    environment's.
    """

    def __init__(
        self,
        env: Environment,
        session: TalariaModel | AgentSessions,
        *,
        tool: str = "bash",
        end_on_submit: bool = True,
    ) -> None:
        self.env = env
        self.tool = tool
        self.end_on_submit = end_on_submit
        if isinstance(session, TalariaModel):
            session.attach_environment()
            self._end: Callable[[], object] = session.end_session
            self.sessions = session.sessions
        else:
            self._end = session.end_run
            self.sessions = session

    @property
    def config(self) -> Any:
        return self.env.config

    def execute(self, action: dict[str, Any], cwd: str = "", **kwargs: Any) -> dict[str, Any]:
        """Run ``action`` in the wrapped environment, reported as a tool gap. Returns and
        raises exactly what the wrapped ``execute`` does."""
        command = action.get("command")
        self.sessions.tool_started(self.tool, command if isinstance(command, str) else None)
        submitted = False
        try:
            result: dict[str, Any] = self.env.execute(action, cwd, **kwargs)
            return result
        except Submitted:
            submitted = self.end_on_submit
            raise
        finally:
            self.sessions.tool_ended(self.tool)
            if submitted:
                self._end()

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        variables: dict[str, Any] = self.env.get_template_vars(**kwargs)
        return variables

    def serialize(self) -> dict[str, Any]:
        data: dict[str, Any] = self.env.serialize()
        return data

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this wrapper lacks (e.g. a Docker container id).
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)


class TalariaAgentMixin:
    """Put before a mini-swe-agent agent class (``class A(TalariaAgentMixin,
    ProgressTrackingAgent)``): when the model is a :class:`TalariaModel`, the environment is
    wrapped in :class:`TalariaEnvironment` (unless it already is) and every ``run`` gets its
    own session, ended when ``run`` returns or raises."""

    model: Any
    env: Any

    def __init__(self, model: Any, env: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(model, TalariaModel) and not isinstance(env, TalariaEnvironment):
            env = TalariaEnvironment(env, model)
        super().__init__(model, env, *args, **kwargs)  # type: ignore[call-arg]

    def run(self, task: str = "", **kwargs: Any) -> dict[str, Any]:
        model = self.model if isinstance(self.model, TalariaModel) else None
        if model is not None:
            model.end_session()  # a previous run's session, if any, is over
        try:
            result: dict[str, Any] = super().run(task, **kwargs)  # type: ignore[misc]
            return result
        finally:
            if model is not None:
                model.end_session()


class TalariaAgent(TalariaAgentMixin, DefaultAgent):
    """mini-swe-agent's ``DefaultAgent`` with :class:`TalariaAgentMixin`; usable as
    ``agent_class: talaria.integrations.swe_agent.mini_swe_agent.TalariaAgent``."""
