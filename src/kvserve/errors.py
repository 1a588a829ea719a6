"""Error types that cross layers (a leaf module: it imports nothing from kvserve).

The server maps them to HTTP statuses by type, never by message text: ParameterError -> 400
naming `param`, QueueFullError -> 429 with Retry-After, RequestFailedError -> 500 for the
requests of a failed step; any other exception is a bug (500, logged with its traceback).
"""

from __future__ import annotations


class UserInputError(ValueError):
    """Input the user can fix (a flag, a file, a request field), with a message that says how.
    The CLI prints it in one line and exits 2; any other exception is a bug (traceback, exit
    1), as any other exception in a request is a 500."""


class ParameterError(UserInputError):
    """One parameter is invalid: `param` names it as the caller spelled it (a request field,
    answered with HTTP 400 and that `param`; or a flag such as --block-size)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param
        self.reason = message

    def renamed(self, param: str) -> ParameterError:
        """The same error under the name the client used (max_completion_tokens, ...)."""
        return ParameterError(param, self.reason)


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-waiting-requests: come back later (HTTP 429)."""

    def __init__(self, num_waiting: int, limit: int) -> None:
        super().__init__(
            f"the server is overloaded: {num_waiting} sequences are waiting, the limit is "
            f"{limit} (--max-waiting-requests); retry later"
        )


class RequestFailedError(RuntimeError):
    """The engine step that computed this request raised; the request was aborted and its
    blocks freed, the engine goes on with the others (HTTP 500)."""
