"""Talaria: serve several LLMs from one accelerator pool to tool-using agents.

``talaria.Talaria`` (the in-process API), ``talaria.SyncTalaria``, ``talaria.TalariaConfig``
and ``talaria.SamplingParams`` are imported lazily: ``import talaria.config`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from talaria.api import SamplingParams, SyncTalaria, Talaria, TalariaConfig

__all__ = ["SamplingParams", "SyncTalaria", "Talaria", "TalariaConfig", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Talaria", "SyncTalaria", "TalariaConfig", "SamplingParams"):
        from talaria import api

        return getattr(api, name)
    raise AttributeError(f"module 'talaria' has no attribute {name!r}")
