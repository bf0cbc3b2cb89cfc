"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a string code.

Handlers raise :class:`APIError`; the app turns it (and Starlette's HTTP errors) into a JSON
response with the right status and headers. Nothing else in the gateway builds error bodies.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",  # a cluster's replica failed (cluster.ingress): not the client's request
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        """The error as a response; ``anthropic`` (the Messages API's paths): with Anthropic's
        ``"type": "error"`` beside the ``error`` object, which its SDK reads as well."""
        body = {"type": "error", **self.body()} if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


ANTHROPIC_PATHS = ("/v1/messages",)


def speaks_anthropic(path: str, headers) -> bool:
    """Whether a request's errors carry Anthropic's ``"type": "error"`` (README, "Anthropic's
    Messages API"): on its paths, and on any request with its SDK's ``anthropic-version`` header
    (``headers``: Starlette's, or an ASGI scope's raw list)."""
    if path.startswith(ANTHROPIC_PATHS):
        return True
    if isinstance(headers, list):
        return any(name == b"anthropic-version" for name, _ in headers)
    return "anthropic-version" in headers


def store_unavailable(what: str = "the key store") -> APIError:
    """A store a request needs did not answer (``accounts.store.STORE_ERRORS``): try again shortly."""
    return APIError(503, f"{what} is unavailable; try again shortly", "store_unavailable",
                    headers={"retry-after": "1"})


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code, param)


def not_found(message: str, param: str | None = None, code: str = "not_found") -> APIError:
    return APIError(404, message, code, param)
