"""Stand-in for triton: decorators that return the function, enough to import SGLang."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from triton import language as language

__version__ = "0.0.0"


def _keep(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


def jit(fn: Callable[..., Any] | None = None, **_options: Any) -> Any:
    return _keep if fn is None else fn


def autotune(*_args: Any, **_options: Any) -> Callable[..., Any]:
    return _keep


def heuristics(*_args: Any, **_options: Any) -> Callable[..., Any]:
    return _keep


class Config:
    def __init__(self, *args: Any, **options: Any) -> None:
        self.args, self.options = args, options


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()
