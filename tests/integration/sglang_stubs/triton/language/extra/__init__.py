"""Stand-in for triton.language.extra: any name (libdevice, ...) is a placeholder."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    return object()
