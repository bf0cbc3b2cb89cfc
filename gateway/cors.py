"""CORS for web pages on other origins (``server.cors_origins``): Starlette's middleware as
``tiergate serve`` and the cluster's ingress both run it. Imports nothing but Starlette, so the
ingress, which loads no model library, can use it."""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

# What a page's script may read of an answer besides the CORS-safelisted headers
EXPOSED_HEADERS = ["x-request-id", "x-tiergate-tier", "retry-after", "retry-after-ms",
                   *(f"x-ratelimit-{what}-{dim}" for what in ("limit", "remaining", "reset") for dim in ("requests", "tokens"))]


def cors(origins: list[str]) -> list[Middleware]:
    """Starlette's CORS middleware for web pages on ``origins`` (``"*"``: any) that call the API
    with a key in the Authorization header (no cookies, so no credentials mode): it answers
    preflight requests before authentication and adds its headers to every answer, errors
    included, so a page reads a 401 or a 429 as such. Nothing for no origins: no CORS headers,
    no work per request."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "PATCH", "DELETE"],
                       allow_headers=["*"], expose_headers=EXPOSED_HEADERS, max_age=600)]
