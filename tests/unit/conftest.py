"""Fixtures shared by more than one test module of tests/unit."""

from .copy_engine_support import engine, layout, pools

__all__ = ["engine", "layout", "pools"]
