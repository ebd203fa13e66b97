"""OpenAI-style API errors and the exception handlers that render them as `{"error": {...}}` bodies."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 409: "conflict_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request", 500: "server_error", 503: "server_error",
          504: "timeout_error"}


class APIError(Exception):
    """An error answered to the client with an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return _ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class _ErrorResponse(JSONResponse):
    """Error bodies in ASCII JSON: a message or param that quotes the client's input (an unpaired surrogate
    included) always renders."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_UNION_MEMBERS = {"str", "int", "float", "bool", "dict", "list", "none", "system", "developer", "user", "assistant",
                  "tool", "NamedToolChoice"}


def _param(loc: tuple) -> str | None:
    """The field path as OpenAI names it: pydantic's union-member steps (`str`, `list[...]`, a tag) dropped."""
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and (p in _UNION_MEMBERS or "[" in p))]
    return ".".join(parts) or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg')}", None, "invalid_json")
    if param is None:
        return bad_request(f"the request body must be a JSON object with the documented fields: {first.get('msg')}",
                           None, "invalid_body")
    if first.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        tag = str((first.get("ctx") or {}).get("discriminator", "")).strip("'")
        param = f"{param}.{tag}" if tag else param
    if first.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return bad_request(f"Invalid value for '{param}': {msg}{more}", param, "invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
