"""Talaria: serve several LLMs from one accelerator pool to tool-using agents."""

__version__ = "0.1.0"
