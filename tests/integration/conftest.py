"""Fixtures of the remote store tests (a host pool, its layout, engines closed at the end)."""

from tests.integration.remote_store_support import engines, host, layout

__all__ = ["engines", "host", "layout"]
