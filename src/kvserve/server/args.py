"""HTTP-server flags of `kvserve serve` (the engine flags come from the config dataclasses)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from kvserve.config import parse_size


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs; built from the flags below."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_request_body_bytes: int = 16 * 2**20
    log_stats_interval: float = 5.0
    shutdown_timeout: float = 30.0
    access_log: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes <= 0:
            raise ValueError("--max-request-body-bytes must be positive, e.g. 16MiB")
        if self.log_stats_interval < 0:
            raise ValueError("--log-stats-interval must be >= 0 seconds (0 turns it off)")
        if self.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be >= 0 seconds")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty (omit it to serve without a key)")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ServerConfig")
    group.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    group.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY") or None,
        help="Require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics "
        "(or set KVSERVE_API_KEY).",
    )
    group.add_argument(
        "--served-model-name", default=None, help="Model name in the API (default: the file's)."
    )
    group.add_argument(
        "--max-request-body-bytes",
        default="16MiB",
        help="Larger request bodies get HTTP 413, e.g. 16MiB.",
    )
    group.add_argument(
        "--log-stats-interval",
        type=float,
        default=5.0,
        help="Seconds between status lines (throughput, queue, KV usage) while busy; 0: off.",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="On SIGTERM, seconds in-flight requests may take to finish before they are aborted.",
    )
    group.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="Do not log one line per HTTP request.",
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """ValueError names the flag."""
    try:
        body_limit = parse_size(args.max_request_body_bytes)
    except ValueError as exc:
        raise ValueError(f"--max-request-body-bytes: {exc}") from None
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_request_body_bytes=body_limit,
        log_stats_interval=args.log_stats_interval,
        shutdown_timeout=args.shutdown_timeout,
        access_log=not args.disable_uvicorn_access_log,
    )
