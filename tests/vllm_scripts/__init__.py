"""Scripts that run inside the vLLM venvs (`tests/vllm_support.py` starts them): each
has a `__main__` guard and prints its findings as one `KVSWAP_RESULT {json}` line."""
