#!/usr/bin/env bash
# Build .venv-sglang, where tests/integration/test_sglang_backend.py runs SGLang's own
# HiCache classes against kvswap's backend. SGLang 0.5.23 goes in without its
# dependencies (its wheel pins a CUDA torch 2.14.1 and sglang-kernel); the main venv's
# packages (torch 2.13 CPU, transformers, numpy, redis, kvswap's own) come through a
# .pth file, so nothing large is installed twice; on top, what SGLang's mem-cache
# modules import at module level. triton and torchvision are not installed: the test
# puts minimal stand-ins (tests/integration/sglang_stubs) on the path. The main venv
# stays free of SGLang, so mypy checks kvswap without it.
#   .ci/sglang-venv.sh [MAIN_VENV]      (default: .venv; a venv already built over it is kept)
set -euo pipefail
cd "$(dirname "$0")/.."
main_venv=${1:-.venv}
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
main_site=$(site_of "$main_venv")
pth() { echo "$(site_of .venv-sglang)/kvswap-main-venv.pth"; }
if [[ -x .venv-sglang/bin/python && "$(cat "$(pth)" 2>/dev/null)" == "$main_site" ]] \
    && .venv-sglang/bin/python -c 'import importlib.metadata as m; m.version("sglang")' 2>/dev/null; then
  echo ".venv-sglang: kept (over $main_venv)"
  exit 0
fi
rm -rf .venv-sglang
python3 -m venv .venv-sglang
echo "$main_site" > "$(site_of .venv-sglang)/kvswap-main-venv.pth"
.venv-sglang/bin/pip install -q --no-deps sglang==0.5.23
.venv-sglang/bin/pip install -q aiohttp apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 \
  dill gguf ipython msgspec orjson psutil pybase64 'pyzmq>=25.1.2' requests sentencepiece==0.2.1
.venv-sglang/bin/python -c 'import importlib.metadata as m, torch; print("sglang", m.version("sglang"), "on torch", torch.__version__)'
