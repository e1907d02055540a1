"""Fixtures shared by every test directory: a throwaway redis-server on loopback, and
a tiny random Llama for the tests that drive the real vLLM (`tests/vllm_support.py`).

OpenMP's idle threads sleep rather than spin in the test process too (as the
command line arranges for itself, before torch loads; a setting of the user's
wins): tests run servers, copy workers and subprocesses beside the model on
few cores, where spinning threads slow every step down."""

from kvswap.openmp_env import cap_onednn_caches, prefer_passive_openmp_wait

prefer_passive_openmp_wait()
cap_onednn_caches()  # as the command line does: bounded oneDNN primitive caches

from tests.redis_server import redis_server, redis_server_factory  # noqa: E402
from tests.vllm_support import tiny_llama_dir  # noqa: E402

__all__ = ["redis_server", "redis_server_factory", "tiny_llama_dir"]
