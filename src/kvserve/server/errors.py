"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause becomes one of these with the offending field in `param`, so
an SDK surfaces a readable message instead of a stack trace; the server itself never fails.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_llm import EngineDeadError
from kvserve.errors import ParameterError, RequestFailedError
from kvserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("kvserve")
M = TypeVar("M", bound=BaseModel)

_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised by handlers; becomes an OpenAI-style JSON error with `status`."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.headers = headers


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    info = ErrorInfo(
        message=message,
        type=_TYPE_BY_STATUS.get(status, "InternalServerError"),
        param=param,
        code=status,
    )
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


def error_body(message: str, status: int = 400, param: str | None = None) -> bytes:
    """The same body as `error_response`, for places that write raw bytes (SSE, ASGI)."""
    return error_response(message, status, param).body


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """("body", "messages", 0, "content", "list[ContentPart]", 1) -> ["messages", "0",
    "content", "1"]: drop FastAPI's "body" and pydantic's union-member tags."""
    path = []
    for part in loc:
        if isinstance(part, int):
            path.append(str(part))
        elif part != "body" and "[" not in part and part.lower() not in _TYPE_TAGS:
            if not part[:1].isupper():  # a model class name, also a union tag
                path.append(part)
    return path


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A 400 for the first pydantic error, `param` = the top-level field the client sent."""
    error = errors[0] if errors else {}
    path = _field_path(tuple(error.get("loc", ())))
    if error.get("type") == "json_invalid":
        detail = error.get("ctx", {}).get("error", error.get("msg"))
        return APIError(f"malformed JSON body: {detail}")
    if not path:
        return APIError(f"request body must be a JSON object ({error.get('msg')})")
    return APIError(f"{'.'.join(path)}: {error.get('msg')}", path[0])


async def parse_body(request: Request, model: type[M]) -> M:
    """Parse the JSON body whatever its Content-Type (curl -d sends form-urlencoded)."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path through `error_response`."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.headers)

    @app.exception_handler(ParameterError)
    async def _parameter(_: Request, exc: ParameterError) -> JSONResponse:
        return error_response(str(exc), 400, exc.param)

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(str(exc), 500)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(list(exc.errors()))
        return error_response(error.message, error.status, error.param)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(str(exc), 503)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        return error_response(message, exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return error_response(f"internal server error: {type(exc).__name__}", 500)
