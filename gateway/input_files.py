"""Files a request names in its messages, read before the messages are made.

Three parts of a message's ``content`` name a file rather than carry what the model reads:

* ``{"type": "input_image", "file_id": ...}``: an image uploaded to ``/v1/files`` (purpose
  ``vision``, checked to be an image when uploaded, or ``user_data``). It becomes the part
  ``{"type": "input_image", "image_url": "data:<type>;base64,..."}``, read as any inline image is
  (``gateway.vision``).
* ``{"type": "input_file", ...}``: a document, given by ``file_id`` (an upload of purpose
  ``user_data`` or ``assistants``) or inline as ``file_data`` (base64, with or without a
  ``data:<type>;base64,`` head) with its ``filename``. Its text, as the vector stores read it
  (``gateway.documents``: PDF, Word, PowerPoint, HTML, UTF-8 text), becomes an ``input_text``
  part headed by the file's name (``FILE_HEAD``); the model reads the text, not the pages'
  images. ``file_url`` is fetched only from a host on ``server.file_url_hosts`` (none by
  default: ``gateway.fetching``); its name is the URL's last path segment unless ``filename``
  says. A document's text is read
  once and kept (``TEXT_CACHE_CHARS``, the least recently read out first): an upload's by its id
  (an upload does not change), inline data's by its SHA-256.
* Chat Completions' ``{"type": "file", "file": {"file_id" | "file_data", "filename"}}``: the
  same document, as a ``text`` part (:func:`chat_files`, on the request's JSON before it is
  parsed; a stored completion keeps that text).

:func:`read_files` makes those parts, on a copy: the items themselves are stored and listed as
they were sent (a file's id, not its bytes). A file is the caller's own (an admin key's: any),
unexpired: anything else is a 404 ``file_not_found`` naming the part
(``input[i].content[j].file_id``), as a missing file is. A file of another purpose, an upload
that is not an image, or a document with no text to read is a 400 naming the part.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import re
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from cachetools import LRUCache

from gateway.auth import Caller
from gateway.documents import Unreadable, document_text
from gateway.errors import bad_request, not_found
from gateway.fetching import client, fetch, host_of, is_remote, listed
from gateway.vision import image_type

if TYPE_CHECKING:
    from batch.store import FileInfo
    from gateway.service import Services

IMAGE_PURPOSES = ("vision", "user_data")  # the uploads an input_image's file_id may name
DOCUMENT_PURPOSES = ("assistants", "user_data")  # ... and an input_file's, and what a vector store reads
FILE_HEAD = "[file: {name}]\n"  # what comes before a document's text in the message
TEXT_CACHE_CHARS = 64 * 2**20  # documents' text kept (the least recently read goes first), in characters
_TEXTS: LRUCache = LRUCache(maxsize=TEXT_CACHE_CHARS, getsizeof=len)  # (kind, upload id or digest, name) -> text
_DATA_HEAD = re.compile(r"data:[^;,]*(;[^;,]*)*?;base64,", re.IGNORECASE)
INLINE_ENCODE = 48 * 1024  # an uploaded image's bytes encoded as base64 on the event loop; more on a thread


def _data_url(media: str, data: bytes) -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _names_image(part: Any) -> bool:
    return (isinstance(part, dict) and part.get("type") == "input_image" and part.get("file_id") is not None
            and part.get("image_url") is None)


def _names_file(part: Any) -> bool:
    return _names_image(part) or (isinstance(part, dict) and part.get("type") == "input_file")


async def read_files(svc: Services, caller: Caller, items: str | list[dict[str, Any]] | None,
                     name: str = "input") -> str | list[dict[str, Any]] | None:
    """``items`` (a Responses input, or a conversation's items called ``name``) with each part that
    names a file replaced by what the model reads of it (the module's docstring); ``items`` as
    they are when no part does."""
    if isinstance(items, str) or not items:
        return items
    out = []
    for i, item in enumerate(items):
        content = item.get("content") if isinstance(item, dict) else None
        if not isinstance(content, list) or not any(_names_file(part) for part in content):
            out.append(item)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"{name}[{i}].content[{j}]"
            if _names_image(part):
                data = await _content(svc, part["file_id"], f"{where}.file_id", await owned_file(
                    svc, caller, part["file_id"], f"{where}.file_id", IMAGE_PURPOSES, "an input_image"))
                media = image_type(data)
                if media is None:
                    raise bad_request("the file is not an image (PNG, JPEG, WebP or GIF)", f"{where}.file_id",
                                      "invalid_image_format")
                url = _data_url(media, data) if len(data) <= INLINE_ENCODE else \
                    await asyncio.to_thread(_data_url, media, data)  # (an upload may be up to 200 MiB)
                part = {**{k: v for k, v in part.items() if k != "file_id"}, "image_url": url}
            elif _names_file(part):
                part = {"type": "input_text", "text": await _document(svc, caller, part, where)}
            parts.append(part)
        out.append({**item, "content": parts})
    return out


async def chat_files(svc: Services, caller: Caller, data: Any) -> Any:
    """A chat request's JSON with each ``file`` part of its messages a ``text`` part of the
    document's text (400s and 404s naming ``messages[i].content[j].file...``); ``data`` as it is
    when none has one."""
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not any(_has_file_part(m) for m in messages):
        return data
    out = []
    for i, message in enumerate(messages):
        if not _has_file_part(message):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(message["content"]):
            if isinstance(part, dict) and part.get("type") == "file":
                where = f"messages[{i}].content[{j}].file"
                if not isinstance(part.get("file"), dict) or set(part) - {"type", "file"}:
                    raise bad_request("a file part is {\"type\": \"file\", \"file\": {\"file_id\" or \"file_data\", "
                                      "\"filename\"}}", where, "invalid_value")
                part = {"type": "text", "text": await _document(svc, caller, part["file"], where)}
            parts.append(part)
        out.append({**message, "content": parts})
    return {**data, "messages": out}


def _has_file_part(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "file" for p in content)


async def _document(svc: Services, caller: Caller, part: dict[str, Any], where: str) -> str:
    """An ``input_file`` part's text, headed by its name."""
    extra = sorted(set(part) - {"type", "file_id", "file_data", "filename", "file_url"})
    if extra:
        raise bad_request(f"unrecognized field of an input_file part: {extra[0]}", f"{where}.{extra[0]}",
                          "unknown_parameter")
    file_id, data, url, filename = (part.get(k) for k in ("file_id", "file_data", "file_url", "filename"))
    given = [k for k, v in (("file_id", file_id), ("file_data", data), ("file_url", url)) if v is not None]
    if not given:
        raise bad_request("an input_file part needs file_id, file_data or file_url", f"{where}.file_id",
                          "missing_required_parameter")
    if len(given) > 1:
        raise bad_request(f"an input_file part takes one of file_id, file_data and file_url, not {' and '.join(given)}",
                          f"{where}.{given[1]}", "invalid_value")
    if filename is not None and not isinstance(filename, str):
        raise bad_request("filename must be a string", f"{where}.filename", "invalid_type")
    if url is not None:
        param = f"{where}.file_url"
        content = await _fetched(svc, url, param)
        filename = filename or unquote(urlsplit(url).path.rsplit("/", 1)[-1]) or "document"
        key = ("inline", await asyncio.to_thread(lambda: hashlib.sha256(content).hexdigest()), filename)
    elif file_id is not None:
        param = f"{where}.file_id"
        info = await owned_file(svc, caller, file_id, param, DOCUMENT_PURPOSES, "an input_file")
        filename = filename or info.filename
        key = ("upload", info.id, filename)  # an upload does not change: its id names its bytes
        content = None if key in _TEXTS else await _content(svc, file_id, param, info)  # (None: kept; no await
        # comes between this look and ``_text``'s, so it is still there)
    else:
        param = f"{where}.file_data"
        if not isinstance(data, str):
            raise bad_request("file_data must be a string (base64)", param, "invalid_type")
        if not filename:
            raise bad_request("an input_file sent as file_data needs its filename", f"{where}.filename",
                              "missing_required_parameter")
        try:
            content, digest = await asyncio.to_thread(_decoded, data)
        except (binascii.Error, ValueError):
            raise bad_request("file_data is not valid base64", param, "invalid_value") from None
        if len(content) > svc.config.batch.max_file_bytes:
            raise bad_request(f"the file is larger than {svc.config.batch.max_file_bytes} bytes", param,
                              "file_too_large")
        key = ("inline", digest, filename)
    return FILE_HEAD.format(name=filename) + await _text(key, content, filename, param)


async def _fetched(svc: Services, url: Any, param: str) -> bytes:
    """The document at ``url``, fetched from a host on ``server.file_url_hosts`` (a 400 naming
    ``param`` for any other, and for a fetch that fails)."""
    if not isinstance(url, str) or not is_remote(url):
        raise bad_request("file_url is an http(s) URL", param, "invalid_value")
    if not listed(url, svc.config.server.file_url_hosts):
        raise bad_request(f"this server does not fetch files from {host_of(url) or 'that URL'}: send the file as "
                          "file_data (base64) or upload it and send its file_id", param, "file_url_not_fetched")
    limits = svc.config.limits
    async with client(limits.file_fetch_timeout_s) as http:
        return await fetch(http, url, param, limits.file_fetch_timeout_s, limits.file_fetch_max_bytes, "file",
                           "file_url_fetch_failed", "file_too_large")


def _decoded(data: str) -> tuple[bytes, str]:
    """``file_data``'s bytes (a ``data:`` head or none) and their SHA-256, off the event loop."""
    head = _DATA_HEAD.match(data)
    content = base64.b64decode(data[head.end() if head else 0:], validate=True)
    return content, hashlib.sha256(content).hexdigest()


async def _text(key: tuple[str, str, str], content: bytes | None, filename: str, param: str) -> str:
    """The document's text: read once (``document_text``, on a thread) and kept in ``_TEXTS``, so
    a conversation over a report does not read the PDF again at every turn."""
    text = _TEXTS.get(key)
    if text is not None:
        return text
    try:
        text = await asyncio.to_thread(document_text, content, filename)
    except Unreadable as exc:
        raise bad_request(exc.message, param, exc.code) from None
    if not text.strip():
        raise bad_request("the file has no text to read (a scanned PDF's pages are images)", param, "invalid_file")
    with contextlib.suppress(ValueError):  # (a text longer than the whole cache is not kept)
        _TEXTS[key] = text
    return text


async def owned_file(svc: Services, caller: Caller, file_id: Any, param: str, purposes: tuple[str, ...],
                     what: str) -> FileInfo:
    """The caller's unexpired upload ``file_id`` (an admin key's: anyone's), of one of ``purposes``
    (what ``what`` reads): a 404 ``file_not_found`` naming ``param`` for a file it cannot see, a
    400 for another purpose."""
    if not isinstance(file_id, str):
        raise bad_request("file_id must be a string", param, "invalid_type")
    info = await svc.files.get_file(file_id) if svc.files is not None else None
    if info is None or info.expired(time.time()) or not (caller.admin or info.owner == caller.key_id):
        raise not_found(f"no such file: '{file_id[:80]}'", param, "file_not_found")
    if info.purpose not in purposes:
        raise bad_request(f"the file's purpose is {info.purpose!r}; {what} reads files uploaded with purpose "
                          f"{' or '.join(map(repr, purposes))}", param, "invalid_file_purpose")
    return info


async def _content(svc: Services, file_id: str, param: str, info: FileInfo) -> bytes:
    data = await svc.files.file_content(info.id)
    if data is None:  # deleted since it was looked up
        raise not_found(f"no such file: '{file_id[:80]}'", param, "file_not_found")
    return data
