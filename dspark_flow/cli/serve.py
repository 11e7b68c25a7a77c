"""`dspark-flow serve RECIPE`: an OpenAI- and Anthropic-compatible HTTP server.

Only argparse here at import time: `dspark-flow --help` must not pay for FastAPI or MLX.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from dspark_flow.cli.args import add_recipe
from dspark_flow.errors import DsparkFlowError
from dspark_flow.server import DEFAULT_MAX_QUEUE

API_KEY_ENV = "DSPARK_FLOW_API_KEY"


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024)."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(raw[-1:], 1)
    number = raw[:-1] if raw[-1:] in units else raw
    try:
        value = int(float(number) * scale)
    except (ValueError, OverflowError):  # OverflowError: inf, 1e400
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G, 1048576)") from None
    if value < 0:
        raise argparse.ArgumentTypeError("sizes must not be negative")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe(p, note="; --set cache.kind=kv turns the prefix cache off")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument(
        "--api-key",
        default=None,  # read from the environment at run time: a default would show in help pages
        help=f"require this key (Bearer or x-api-key); default ${API_KEY_ENV}",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation on load")
    p.add_argument(
        "--cache-bytes",
        type=_size,
        default=None,
        metavar="N",
        help="ceiling for KV bytes the prefix cache keeps (default 512M; 0 disables reuse)",
    )
    p.add_argument(
        "--max-active-bytes",
        type=_size,
        default=None,
        metavar="N",
        help="evict prefix entries before a request while MLX's active memory is above this "
        "(default: 90%% of MLX's memory limit)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_size,
        default="4M",
        metavar="N",
        help="largest request body accepted (default 4M; larger gets 413)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        metavar="N",
        help=f"requests that may wait behind the running one (default {DEFAULT_MAX_QUEUE}; "
        "more get 429 at once; 0: no limit)",
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    from dspark_flow.log import get_logger
    from dspark_flow.server.app import create_app
    from dspark_flow.server.config import ServerConfig, build_pipeline
    from dspark_flow.server.engine import Engine
    from dspark_flow.server.runner import bind, serve_forever

    log = get_logger()
    if not 0 <= args.port <= 65535:
        raise DsparkFlowError(f"--port must be between 0 and 65535, got {args.port}")
    if args.max_body_bytes < 1:
        raise DsparkFlowError("--max-body-bytes must be at least 1")
    if args.max_queue < 0:
        raise DsparkFlowError("--max-queue must be at least 0 (0: no limit)")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        # `--api-key "$KEY"` with KEY unset would otherwise serve without any key at all.
        raise DsparkFlowError(
            f"the API key (--api-key or ${API_KEY_ENV}) is empty; give a key, or leave both "
            "unset to serve without one"
        )
    if not args.host.strip():
        raise DsparkFlowError("--host is empty (0.0.0.0 serves every interface, if meant)")
    if not _is_loopback(args.host) and not api_key:
        log.warning("serving beyond loopback without --api-key", host=args.host)

    pipeline = build_pipeline(
        args.recipe,
        args.overrides,
        cache_bytes=args.cache_bytes,
        max_active_bytes=args.max_active_bytes,
    )
    config = ServerConfig.for_recipe(
        pipeline.recipe,
        api_key=api_key or None,
        max_body_bytes=args.max_body_bytes,
        max_queue=args.max_queue or None,
    )
    sock = bind(args.host, args.port)  # fail fast on a taken port, before loading the model
    engine = Engine(pipeline, warmup=not args.no_warmup, max_active_bytes=args.max_active_bytes)
    print(f"loading {config.target} ...", file=sys.stderr, flush=True)
    engine.start(log_failure=False).wait_ready()  # the failure is this command's one error line
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"serving '{config.model_id}' (drafter {engine.drafter_kind}, cache "
        f"{engine.cache_stats()['kind']}) on http://{shown}:{port}/v1",
        file=sys.stderr,
        flush=True,
    )
    try:
        serve_forever(create_app(engine, config), sock, log_level=args.log_level.lower())
    finally:
        engine.stop()
        sock.close()
    return 0
