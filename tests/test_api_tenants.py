"""Tenant configuration and session scoping in the in-process API (no model is loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from talaria.api import DEFAULT_TENANT, SessionKey, TalariaConfig
from talaria.errors import ConfigError


def test_tenants_come_from_the_toml(tmp_path: Path) -> None:
    path = tmp_path / "talaria.toml"
    path.write_text('api_keys = ["k1"]\n\n[tenants]\n"k2" = "team-b"\n', encoding="utf-8")
    config = TalariaConfig.from_toml(path)
    assert config.api_keys == ("k1",) and config.tenants == {"k2": "team-b"}


@pytest.mark.parametrize("name", ["", DEFAULT_TENANT, "x" * 65, "tab\there"])
def test_bad_tenant_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="tenant names"):
        TalariaConfig(tenants={"k": name})


def test_a_session_is_keyed_by_tenant_and_id() -> None:
    a, b = SessionKey("team-a", "s1"), SessionKey("team-b", "s1")
    assert a != b and a != SessionKey(DEFAULT_TENANT, "s1") and hash(a) != hash(b)


def test_the_tenant_limits_come_from_the_toml_and_must_be_positive(tmp_path: Path) -> None:
    path = tmp_path / "talaria.toml"
    path.write_text(
        "tokens_per_minute_per_tenant = 90000\nmax_sessions_per_tenant = 64\n", encoding="utf-8"
    )
    config = TalariaConfig.from_toml(path)
    assert (config.tokens_per_minute_per_tenant, config.max_sessions_per_tenant) == (90_000, 64)
    default = TalariaConfig()  # no limit by default
    assert default.tokens_per_minute_per_tenant is None and default.max_sessions_per_tenant is None
    for knob in ("tokens_per_minute_per_tenant", "max_sessions_per_tenant"):
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ConfigError, match=knob):
                TalariaConfig(**{knob: bad})
