"""Fixtures shared by every test directory: a throwaway redis-server on loopback."""

from tests.redis_server import redis_server, redis_server_factory

__all__ = ["redis_server", "redis_server_factory"]
