"""Agent-framework integrations of Talaria.

* :mod:`talaria.integrations.litellm`: a LiteLLM custom provider (``model="talaria/<model>"``),
  against a Talaria server or an embedded in-process ``Talaria``.
* :mod:`talaria.integrations.langchain`: ``ChatTalaria`` (a LangChain chat model) and
  ``TalariaCallbackHandler`` (tool runs become tool-gap hints).
* :mod:`talaria.integrations.swe_agent`: mini-swe-agent and SWE-agent hooks and runs.

Session ids and tool-gap hints come from :mod:`talaria.session` (docs/design.md, "Wire format
for sessions"). Tool calls are the server's: Talaria reads them from the model's output
into OpenAI ``tool_calls`` and renders the history's calls for the model's chat template
(``talaria.api.tool_choice``), so no integration parses text.
"""
