"""Fetching a URL a request names, from the hosts tiers.yaml lists.

A gateway that fetched any URL would let every key make it request addresses on its own network,
so a URL is fetched only when its host is listed (``listed``: exact names, or ``*.example.com``
for its subdomains): ``server.image_url_hosts`` for images in messages (``gateway.vision``),
``server.file_url_hosts`` for documents (``gateway.input_files``). A fetch (``fetch``) follows no
redirect (it could leave the listed hosts), reads no proxy settings from the environment, and
gives up after its timeout (the whole fetch, not each read) or past its size; each failure is a
400 naming the part.
"""

from __future__ import annotations

import asyncio
import fnmatch
from urllib.parse import urlsplit

from gateway.errors import bad_request


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))  # a scheme is case-insensitive (RFC 3986)


def listed(url: str, hosts: list[str]) -> bool:
    """Whether the http(s) ``url``'s host is one of ``hosts`` (a pattern ``*.example.com`` takes
    its subdomains)."""
    host = urlsplit(url).hostname or ""
    return bool(host) and any(fnmatch.fnmatchcase(host, pattern.lower()) for pattern in hosts)


def host_of(url: str) -> str:
    return urlsplit(url).hostname or ""


def client(timeout_s: float):
    """The HTTP client fetches go through: no redirects, no proxy settings from the environment."""
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), follow_redirects=False, trust_env=False)


async def fetch(http, url: str, param: str, timeout_s: float, max_bytes: int, what: str,
                failed_code: str, too_large_code: str) -> bytes:
    """The body of ``url`` (``what`` it is, for the message) through ``http`` (``client``): a 400
    ``failed_code`` naming ``param`` for an error status, a redirect, a transport error or the
    timeout, ``too_large_code`` past ``max_bytes``."""
    import httpx

    def failed(why: str) -> Exception:
        return bad_request(f"the {what} at {url[:200]} could not be fetched: {why}", param, failed_code)

    try:
        async with asyncio.timeout(timeout_s):  # the whole fetch, not each read
            async with http.stream("GET", url) as response:
                if response.is_redirect:
                    raise failed(f"it answered {response.status_code}, a redirect, which is not followed")
                if response.status_code != 200:
                    raise failed(f"it answered {response.status_code}")
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > max_bytes:
                        raise bad_request(f"the {what} at {url[:200]} is larger than this server's limit of "
                                          f"{max_bytes} bytes", param, too_large_code)
    except TimeoutError:
        raise failed(f"no whole answer within {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise failed(type(exc).__name__) from None
    return bytes(data)
