"""HTTP-server flags of `kvserve serve` (the engine flags come from the config dataclasses)."""

from __future__ import annotations

import argparse
import os


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ServerConfig")
    group.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    group.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on /v1/* (or set KVSERVE_API_KEY).",
    )
    group.add_argument(
        "--served-model-name", default=None, help="Model name in the API (default: the file's)."
    )
