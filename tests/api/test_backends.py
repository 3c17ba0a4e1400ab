"""The backend registry: one builder per backend a config may name, each returning the one
shape the API reads."""

from __future__ import annotations

import anyio
import pytest

from talaria.api import Talaria, TalariaConfig, backends
from talaria.api.config import BACKENDS
from talaria.backends.embedded import EmbeddedCluster
from talaria.backends.served import ServedCluster
from talaria.errors import ConfigError
from tests.reliability.inprocess import TINY, requires_tiny_model, tiny_config


def test_every_backend_a_config_may_name_has_a_builder() -> None:
    assert set(backends.BUILDERS) == set(BACKENDS)


@requires_tiny_model
def test_the_embedded_builder_makes_the_served_shape() -> None:
    cluster = backends.build(tiny_config())
    assert isinstance(cluster, EmbeddedCluster) and isinstance(cluster, ServedCluster)
    assert set(cluster.archs) == {TINY} and set(cluster.runners) == set(cluster.core.instances)
    assert cluster.mechanisms() == [
        "embedded engine: slots, switches, staging, host KV tier all Talaria's own"
    ]
    cluster.close()  # nothing outside this process: a no-op, twice too
    cluster.close()


@requires_tiny_model
def test_the_api_reports_its_backends_mechanisms() -> None:
    async def main() -> list[str]:
        async with Talaria(tiny_config()) as t:
            return t.mechanisms()

    assert anyio.run(main) == [
        "embedded engine: slots, switches, staging, host KV tier all Talaria's own"
    ]


def test_an_unknown_backend_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="backend must be one of"):
        TalariaConfig(models=(TINY,), backend="tensorrt")
