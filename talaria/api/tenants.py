"""Tenant scoping: how a tenant's session ids are kept apart from every other tenant's.

The runtime (``talaria.runtime.live``) keys sessions by one string; ``talaria.api.talaria``
scopes each client id with its tenant before it reaches the runtime. The tenant of an HTTP
caller comes from its API key (``talaria.server.middleware``).
"""

from __future__ import annotations

DEFAULT_TENANT = "default"
_TENANT_SEPARATOR = "\x1f"  # never in a wire session id (printable ASCII only)


def scoped_session_id(tenant: str, session_id: str) -> str:
    """A tenant's session id as the runtime keys it: tenants never share a session (their
    hints reach only their sessions; their calls never reuse each other's). The default
    tenant's ids are unchanged; no wire id can collide with a scoped one."""
    if tenant == DEFAULT_TENANT:
        return session_id
    return f"{tenant}{_TENANT_SEPARATOR}{session_id}"
