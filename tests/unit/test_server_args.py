"""The HTTP layer's flags that the end-to-end tests run with other values to save time."""

from __future__ import annotations

import pytest

from kvserve.errors import ParameterError
from kvserve.server.args import ServerConfig


def test_the_stream_stall_timeout_defaults_to_a_minute_and_refuses_negative_values():
    """tests/e2e/test_no_client_hurts_another.py aborts a stalled stream after 6 s; served
    without the flag, a stalled client is aborted after 60 s."""
    assert ServerConfig().stream_stall_timeout == 60.0
    assert ServerConfig(stream_stall_timeout=0).stream_stall_timeout == 0  # never
    with pytest.raises(ParameterError, match="--stream-stall-timeout"):
        ServerConfig(stream_stall_timeout=-1)
