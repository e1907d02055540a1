"""Stand-in for triton.language: every name is a placeholder type."""

from __future__ import annotations

from typing import Any


class constexpr:  # triton's name
    def __init__(self, value: Any = None) -> None:
        self.value = value


def __getattr__(name: str) -> Any:
    return constexpr
