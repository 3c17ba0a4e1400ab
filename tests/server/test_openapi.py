"""The published OpenAPI document describes every request body and every error answer, so
a schema-driven client or fuzzer can read the whole API."""

from __future__ import annotations

import httpx

from talaria.server import anthropic_requests, requests, responses_api
from talaria.server.openapi import REQUEST_ERRORS, request_bodies

POSTS = {
    ("POST", "/v1/chat/completions"): requests.ChatCompletionRequest,
    ("POST", "/v1/completions"): requests.CompletionRequest,
    ("POST", "/v1/sessions/{session_id}/events"): requests.EventRequest,
    ("POST", "/tokenize"): requests.TokenizeRequest,
    ("POST", "/detokenize"): requests.DetokenizeRequest,
    ("POST", "/v1/responses"): responses_api.ResponsesRequest,
    ("POST", "/v1/messages"): anthropic_requests.MessagesRequest,
    ("POST", "/v1/messages/count_tokens"): anthropic_requests.CountTokensRequest,
}


def test_every_post_has_its_request_body_and_errors(client: httpx.Client) -> None:
    doc = client.get("/openapi.json").json()
    bodies = request_bodies(doc)
    assert bodies == {op: model.__name__ for op, model in POSTS.items()}
    components = doc["components"]["schemas"]
    for (method, path), model in POSTS.items():
        published = components[model.__name__]
        assert published["properties"].keys() == model.model_json_schema()["properties"].keys()
        responses = doc["paths"][path][method.lower()]["responses"]
        assert sorted(int(s) for s in responses) == sorted((200, *REQUEST_ERRORS))
        assert "422" not in responses  # the handlers answer 400 in OpenAI's shape
    assert components["Error"]["required"] == ["error"]
    assert components["AnthropicError"]["required"] == ["type", "error"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        bad = doc["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]
        assert bad["schema"] == {"$ref": "#/components/schemas/AnthropicError"}
    assert "HTTPValidationError" not in components
