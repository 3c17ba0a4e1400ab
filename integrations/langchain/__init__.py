"""Talaria for LangChain: ``ChatTalaria`` (a chat model) and ``TalariaCallbackHandler``
(tool runs become tool-gap hints).

Supported: langchain-core >= 1.0 (checked against 1.8.3; it relies on ``BaseChatModel``,
``chunk_position`` and ``convert_to_openai_messages``), with the ``openai`` client
(>= 1.40; checked against 3.57) for HTTP. LangGraph is not required; when used, its
``thread_id`` names the session.

::

    from talaria.integrations.langchain import ChatTalaria, TalariaCallbackHandler

    llm = ChatTalaria(base_url="http://127.0.0.1:8000", model="smollm2-135m")
    hints = TalariaCallbackHandler("http://127.0.0.1:8000")
    config = {"metadata": {"session_id": "agent-1"}, "callbacks": [hints]}
    agent = llm.bind_tools([run_shell])
    answer = agent.invoke(messages, config)           # X-Session-ID: agent-1
    for call in answer.tool_calls:                    # tool_start / tool_end hints
        messages.append(run_shell.invoke(call, config))
    hints.end("agent-1")                              # the session is over

Every call of one agent run carries one session id (so the server keeps its KV and
reserves room across tool gaps); ``answer.usage_metadata["input_token_details"]
["cache_read"]`` reports the prompt tokens the server reused.
"""

from talaria.integrations.langchain.callbacks import TalariaCallbackHandler
from talaria.integrations.langchain.chat_model import ChatTalaria

__all__ = ["ChatTalaria", "TalariaCallbackHandler"]
