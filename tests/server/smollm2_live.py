"""A live SmolLM2-135M server (float32, one torch thread while it serves) and its config:
what the test modules that compare HTTP answers with the in-process API's share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from talaria.api import TalariaConfig
from talaria.server.app import app_for_config
from tests.server.server_fakes import live_server

MODEL = "smollm2-135m"


def config() -> TalariaConfig:
    return TalariaConfig(
        models=(MODEL,),
        device_memory_bytes=10**9,
        host_memory_bytes=10**9,
        dtype="float32",
        shutdown_grace_s=5.0,
    )


@contextlib.contextmanager
def served() -> Iterator[str]:
    """The server's base URL while it runs (see test_server_live: shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with live_server(app_for_config(config())) as base:
            yield base
    finally:
        torch.set_num_threads(threads)
