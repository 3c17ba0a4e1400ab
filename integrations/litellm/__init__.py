"""Talaria as a LiteLLM provider: ``litellm.completion(model="talaria/<model>", ...)``.

Supported: LiteLLM >= 1.110 (``litellm.CustomLLM``; checked against 1.110.2), with the
``openai`` client LiteLLM depends on.

In code::

    import litellm
    from talaria.integrations.litellm import register

    talaria = register()                      # installs provider "talaria"
    with talaria.session("http://127.0.0.1:8000") as session:   # one agent run
        answer = litellm.completion(
            model="talaria/smollm2-135m",
            messages=messages,
            api_base="http://127.0.0.1:8000",  # a `talaria serve`; omit for embedded
            litellm_session_id=session.session_id,
        )
        session.tool_started("bash", command="ls")   # tool-gap hint, never blocks
        ...                                           # run the tool
        session.tool_ended()
    # leaving the block sends the session's "end"

``completion`` / ``acompletion``, with or without ``stream=True``, all work. Usage carries
``prompt_tokens_details.cached_tokens`` (prompt tokens whose KV the server reused). The
session id is read, in order, from an ``X-Session-ID`` header (``extra_headers``), a
``session_id`` argument (or ``extra_body={"session_id": ...}``), LiteLLM's
``litellm_session_id``, then ``metadata={"session_id": ...}``; it is sent as
``X-Session-ID``. Without one, each call is its own one-call session. A server that needs
an API key gets the call's ``api_key``, else ``$TALARIA_API_KEY``.

Without ``api_base`` the handler serves the call from an embedded ``talaria.Talaria``,
started on the first such call (loading takes tens of seconds) on a daemon thread with its
own event loop, one per handler, so one per process for the module-level handler
(``TalariaLLM(embedded_config=...)`` chooses what it serves; ``attach_embedded`` reuses a
Talaria you already run). ``talaria_llm.close()`` stops it.

Errors are LiteLLM's own exceptions (:mod:`talaria.integrations.litellm.errors`): an unknown model
raises ``litellm.NotFoundError``, a refused request ``litellm.BadRequestError``, an
unreachable server ``litellm.APIConnectionError`` within ``connect_timeout_s`` (5 s by
default), a slow one ``litellm.Timeout`` after the call's ``timeout``. Streamed calls fail
the same way, from ``completion`` / ``await acompletion`` themselves (the call starts
before the stream is returned); an error after the first chunk comes from iterating it.

LiteLLM proxy (``litellm --config config.yaml``), with this repository importable::

    model_list:
      - model_name: smollm2
        litellm_params:
          model: talaria/smollm2-135m
          api_base: http://127.0.0.1:8000
    litellm_settings:
      custom_provider_map:
        - {"provider": "talaria", "custom_handler": talaria.integrations.litellm.talaria_llm}

The proxy needs its dependencies: ``pip install -e '.[litellm-proxy]'`` (LiteLLM's own
``litellm[proxy]`` pins a ``litellm-proxy`` package the registry may not serve, so the extra
lists them by name), a ``general_settings.master_key``, and ``PYTHONPATH`` naming this
repository. Clients then name their session with ``"litellm_session_id"`` (or ``"metadata":
{"session_id": ...}``) in the request body; hints reach Talaria through a pass-through route::

    general_settings:
      master_key: sk-...
      pass_through_endpoints:
        - {"path": "/talaria/sessions", "target": "http://127.0.0.1:8000/v1/sessions",
           "include_subpath": true}

(``POST /talaria/sessions/<id>/events`` on the proxy, with the proxy's key;
``tests/integrations/test_litellm_proxy.py`` runs all of it.)
Offline, set ``LITELLM_LOCAL_MODEL_COST_MAP=True``: LiteLLM otherwise fetches its model
price list at import and retries for seconds before falling back to its bundled copy.

Module-level state: ``talaria_llm`` (below) is the handler instance that the proxy's
``custom_handler`` and :func:`register` point LiteLLM at; LiteLLM's registry is a global
list of handler instances, so the instance has to live at module level. It opens nothing
until a call needs it.
"""

from __future__ import annotations

from talaria.integrations.litellm.call import (
    Answer,
    Call,
    Piece,
    ServerError,
    TimedOut,
    Unreachable,
    Usage,
)
from talaria.integrations.litellm.embedded import EmbeddedTalaria
from talaria.integrations.litellm.errors import to_litellm_error
from talaria.integrations.litellm.http import HttpBackend
from talaria.integrations.litellm.provider import PROVIDER, TalariaLLM, register

__all__ = [
    "PROVIDER",
    "Answer",
    "Call",
    "EmbeddedTalaria",
    "HttpBackend",
    "Piece",
    "ServerError",
    "TalariaLLM",
    "TimedOut",
    "Unreachable",
    "Usage",
    "register",
    "talaria_llm",
    "to_litellm_error",
]

talaria_llm = TalariaLLM()
"""The process-wide handler (LiteLLM's registry needs an instance; see the docstring)."""
