"""`kvswap serve`: the reference engine behind an OpenAI-compatible HTTP API.

    flags checked -> port bound -> engine built (pools, weights, its thread)
    -> text loaded (tokenizer, chat template) -> app served until a stop signal
    -> service closed (open requests finish or are aborted by --shutdown-timeout-s,
       pools released, the NVMe slab removed) -> exit 0

A stop signal before the server is up unwinds like any command (128 + N); once
it listens, SIGINT / SIGTERM / SIGHUP / SIGQUIT are its normal way to end: exit 0.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from kvswap.commands.argument_text import api_key_text, utf8_text
from kvswap.commands.common import add_config_arguments, config_from_args
from kvswap.commands.engine_flags import (
    add_model_arguments,
    add_vllm_arguments,
    check_vllm_arguments,
    dtype_flag,
    model_flag,
)
from kvswap.commands.run import engine_model
from kvswap.config import KvSwapConfig
from kvswap.config_sources import API_KEY_VARIABLE
from kvswap.errors import KvSwapError
from kvswap.obs.prometheus import is_loopback_address
from kvswap.redact import redact_url
from kvswap.serve.app import BODY_READ_TIMEOUT_S, AppSettings, body_limit_bytes, build_app
from kvswap.serve.http_server import HEADER_READ_TIMEOUT_S, ApiServer, bind_listener
from kvswap.serve.server_log import DEFAULT_STATS_INTERVAL_S, configure_server_log, log
from kvswap.signals import signal_name

if TYPE_CHECKING:
    from kvswap.serve.engine_service import EngineThreadService

DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
#: Tier sizes when neither flags, KVSWAP_* nor --config give them: room for a few
#: thousand-token conversations of the built-in `small` model (256 GPU blocks of 16
#: tokens, 512 pinned CPU blocks); size a real checkpoint's tiers in bytes instead.
SERVE_DEFAULTS: dict[str, object] = {
    "gpu_kv_capacity_blocks": 256,
    "cpu_kv_capacity_blocks": 512,
    "protected_sink_blocks": 2,
    "max_num_seqs": 16,
}
MAX_PORT = 65535


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve the reference engine over an OpenAI-compatible HTTP API",
        description="Serve a Llama-family model over the tiered KV store: /v1/completions, "
        "/v1/chat/completions (streaming or not), /v1/models, /health, /metrics.",
    )
    add_model_arguments(
        parser,
        model_help="checkpoint dir (its tokenizer.json and chat template give text) or preset "
        "(tiny, small: a built-in byte-level tokenizer); default: [model] preset, else small",
    )
    group = parser.add_argument_group("server")
    group.add_argument(
        "--host", default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; 0.0.0.0 exposes it to the network)",
    )  # fmt: skip
    group.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any)")
    group.add_argument(
        "--api-key", default=None,
        help=f"require `Authorization: Bearer KEY` on /v1 (default: ${API_KEY_VARIABLE})",
    )  # fmt: skip
    group.add_argument(
        "--served-model-name", default=None,
        help="the model's name in the API (default: the --model basename)",
    )  # fmt: skip
    group.add_argument(
        "--max-prompt-tokens", type=int, default=None,
        help="longer prompts get 413 (default: the model's context length)",
    )  # fmt: skip
    group.add_argument(
        "--max-waiting-requests", type=int, default=None,
        help="requests queued beyond max_num_seqs before 429 (default 256)",
    )  # fmt: skip
    group.add_argument(
        "--disable-log-requests", action="store_true",
        help="no access line per request (vLLM's flag); refusals and aborts are still said",
    )  # fmt: skip
    group.add_argument(
        "--disable-log-stats", action="store_true",
        help="no stats line while requests run (throughput, running/waiting, KV usage per "
        "tier, link, swap wait)",
    )  # fmt: skip
    group.add_argument(
        "--log-stats-interval-s", type=float, default=DEFAULT_STATS_INTERVAL_S, metavar="S",
        help="seconds between stats lines (default %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--shutdown-timeout-s", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on a stop signal, open requests get this long to finish (default 10)",
    )  # fmt: skip
    group.add_argument(
        "--header-read-timeout-s", type=float, default=HEADER_READ_TIMEOUT_S,
        help=f"a connection gets this long to send a request's headers, else it is closed "
             f"(default {HEADER_READ_TIMEOUT_S:g})",
    )  # fmt: skip
    group.add_argument(
        "--body-read-timeout-s", type=float, default=BODY_READ_TIMEOUT_S,
        help=f"a request's body must arrive within this long, else 408 "
             f"(default {BODY_READ_TIMEOUT_S:g})",
    )  # fmt: skip
    add_config_arguments(parser, ("cache", "swap", "tiers", "engine"))
    add_vllm_arguments(parser)
    parser.set_defaults(handler=serve)


def check_server_arguments(args: argparse.Namespace) -> None:
    """The flags no other reader checks, before a port is bound or a weight loaded."""
    utf8_text(args.host, "--host")
    if not 0 <= args.port <= MAX_PORT:
        raise KvSwapError(f"--port {args.port}: allowed: 0..{MAX_PORT} (0: any free port)")
    for flag, value in (
        ("--max-prompt-tokens", args.max_prompt_tokens),
        ("--max-waiting-requests", args.max_waiting_requests),
    ):
        if value is not None and value < 1:
            raise KvSwapError(f"{flag} {value}: allowed: an integer >= 1")
    timeout_s = args.shutdown_timeout_s
    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise KvSwapError(f"--shutdown-timeout-s {timeout_s}: allowed: a number >= 0")
    for flag, value in (
        ("--header-read-timeout-s", args.header_read_timeout_s),
        ("--body-read-timeout-s", args.body_read_timeout_s),
    ):
        if not math.isfinite(value) or value <= 0:
            raise KvSwapError(f"{flag} {value}: allowed: a number > 0")
    interval_s = args.log_stats_interval_s
    if not math.isfinite(interval_s) or interval_s <= 0:
        raise KvSwapError(f"--log-stats-interval-s {interval_s}: allowed: a number > 0")
    name = args.served_model_name
    if name is not None and not utf8_text(name, "--served-model-name").strip():
        raise KvSwapError("--served-model-name: empty; allowed: any non-empty name")


def api_key(args: argparse.Namespace) -> str | None:
    key: str | None = args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE)
    source = "--api-key" if args.api_key is not None else API_KEY_VARIABLE
    if key is not None and not key.strip():
        raise KvSwapError(f"{source}: empty; give a key, or leave it unset to serve without one")
    return None if key is None else api_key_text(key, source)


def serve(args: argparse.Namespace) -> int:
    check_server_arguments(args)
    check_vllm_arguments(args)
    key = api_key(args)
    defaults = dict(SERVE_DEFAULTS)
    if args.gpu_memory_utilization is not None:
        del defaults["gpu_kv_capacity_blocks"]  # the share sizes the device tier
    config = config_from_args(args, defaults)
    listener = bind_listener(args.host, args.port)
    try:
        address = str(listener.getsockname()[0])
        if not is_loopback_address(address):
            # Said before the engine loads: an open port is a security decision.
            unguarded = "" if key is not None else ", and no --api-key is set"
            print(
                f"kvswap: warning: --host {args.host} is not a loopback address; the API on "
                f"port {listener.getsockname()[1]} is reachable from other machines{unguarded}",
                file=sys.stderr,
            )
        return _serve_on(args, config, listener, key)
    finally:
        listener.close()


def _serve_on(
    args: argparse.Namespace, config: KvSwapConfig, listener: socket.socket, key: str | None
) -> int:
    # Imported here: the engine side (torch, the model) is the integrator's to build,
    # and nothing of it is needed to parse flags or to test the HTTP side.
    from kvswap.engine.settings import EngineOptions, engine_settings
    from kvswap.serve.engine_service import DEFAULT_MAX_WAITING_REQUESTS, build_engine_service
    from kvswap.serve.tokenizer import load_text

    configure_server_log(log_requests=not args.disable_log_requests)
    model, dtype = engine_model(model_flag(args), dtype_flag(args), config)
    options = EngineOptions(
        model, dtype, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )  # fmt: skip
    service = build_engine_service(
        engine_settings(config, options),
        served_model_name=args.served_model_name,
        max_prompt_tokens=args.max_prompt_tokens,
        max_waiting_requests=args.max_waiting_requests or DEFAULT_MAX_WAITING_REQUESTS,
        stats_interval_s=None if args.disable_log_stats else args.log_stats_interval_s,
    )
    log.info(startup_summary(service))
    timeout_s = float(args.shutdown_timeout_s)
    try:
        vocab_size = service.engine.arch.vocab_size
        codec = load_text(model, vocab_size)
        if codec is None:
            print(
                f"kvswap serve: {model} has no tokenizer.json: token-id prompts only",
                file=sys.stderr,
            )
        settings = AppSettings(
            api_key=key,
            max_body_bytes=body_limit_bytes(service.max_prompt_tokens, codec),
            model_vocab_size=vocab_size,
            body_read_timeout_s=args.body_read_timeout_s,
        )
        app = build_app(service, codec, settings)
        server = ApiServer(
            app, service, model_name=service.model_id, shutdown_timeout_s=timeout_s,
            header_read_timeout_s=args.header_read_timeout_s,
        )  # fmt: skip
        stopped_by = server.run([listener])
    finally:
        service.close(timeout_s)  # a second close is a no-op; here for a start-up failure
    if stopped_by is not None:
        print(f"kvswap serve: stopped by {signal_name(stopped_by)}", file=sys.stderr)
    return 0


def startup_summary(service: EngineThreadService) -> str:
    """The start-up line: the model, its tiers in blocks and tokens, the concurrency."""
    engine = service.engine
    settings = engine.settings
    block_tokens = settings.control.layout.block_tokens
    capacities = settings.capacities

    def tier(name: str, num_blocks: int) -> str:
        if not num_blocks:
            return f"{name} -"
        return f"{name} {num_blocks:,} blocks ({num_blocks * block_tokens:,} tokens)"

    remote = settings.remote_store
    return (
        f"kvswap serve: model {service.model_id} ({engine.arch.dtype_name} on {engine.device}), "
        f"{block_tokens}-token blocks; tiers: {tier('GPU', capacities.num_gpu_blocks)}, "
        f"{tier('CPU', capacities.num_cpu_blocks)}, {tier('NVMe', capacities.num_nvme_blocks)}, "
        f"remote {redact_url(remote.url) if remote is not None else '-'}; up to "
        f"{settings.control.scheduler.max_num_seqs} running sequences, a request at most "
        f"{service.max_model_tokens:,} tokens"
    )
