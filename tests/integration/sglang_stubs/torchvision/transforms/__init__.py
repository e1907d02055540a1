"""Stand-in for torchvision.transforms: every name is a do-nothing class."""

from __future__ import annotations

from typing import Any


class _Placeholder:
    def __init__(self, *args: Any, **options: Any) -> None:
        pass


def __getattr__(name: str) -> Any:
    return _Placeholder
