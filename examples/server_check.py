"""What every example checks first: is a Talaria server up at the base URL, serving the model?

Imported by the examples as a sibling module (they run as scripts from this folder).
"""

from __future__ import annotations

import httpx


def server_ready(base_url: str, api_key: str | None, model: str) -> str | None:
    """None when the server answers and serves ``model``, else what is wrong."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        health = httpx.get(f"{base_url}/health", timeout=3.0)
        models = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=3.0)
    except httpx.HTTPError as exc:
        return (
            f"no Talaria server at {base_url} ({exc}). Start one with `talaria serve` "
            "(it listens on 127.0.0.1:8000), or pass --base-url."
        )
    if health.status_code != 200:
        return f"the server at {base_url} is not healthy: {health.text[:200]}"
    if models.status_code != 200:
        return f"GET /v1/models failed ({models.status_code}): {models.text[:200]}"
    served = [m["id"] for m in models.json().get("data", [])]
    if model not in served:
        return f"the server does not serve {model!r}; it serves {served}"
    return None
