"""Multipart uploads (``multipart/form-data``) as the upload endpoints read them: the body parsed
with Starlette's parser under a byte cap that also stops a body sent without a length, refused
when it ends before its closing boundary, and the text fields gathered for validation. Used by
transcriptions, translations, image edits and variations, and the Files and Uploads APIs."""

from __future__ import annotations

from collections.abc import AsyncIterator

from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from gateway.errors import APIError, bad_request
from gateway.schemas import is_count

FORM_SLACK = 64 * 1024  # multipart bytes allowed beyond the files: boundaries and the other fields


class Multipart:
    """``async with Multipart(request, max_file_bytes, ...) as form``: the parsed multipart body,
    its uploads closed afterwards. 415 when the body is not multipart/form-data (``expects`` says
    what it should carry), 413 past the cap (counted as it streams, so a body without
    Content-Length is cut off too; ``param`` names the field the error points at, ``too_large``
    says it otherwise), 400 when it is malformed or ends before its closing boundary (a body cut
    short, which the parser takes without a word, keeping only the parts that ended)."""

    def __init__(self, request: Request, max_file_bytes: int, expects: str, param: str, max_files: int = 1,
                 max_fields: int = 32, too_large: APIError | None = None) -> None:
        self.request = request
        self.max_bytes = max_file_bytes + FORM_SLACK
        self.expects = expects
        self.param = param
        self.max_files = max_files
        self.max_fields = max_fields
        self.too_large = too_large or APIError(
            413, f"the upload is larger than this server's limit of {max_file_bytes} bytes", "request_too_large", param)
        self.form: FormData | None = None
        self.closed = False  # the body's closing boundary arrived

    async def __aenter__(self) -> FormData:
        content_type, options = parse_options_header(self.request.headers.get("content-type", ""))
        if content_type != b"multipart/form-data":
            raise APIError(415, f"this endpoint takes multipart/form-data with {self.expects} "
                                f"(got {content_type.decode('latin-1') or 'no content type'})", "unsupported_media_type")
        declared = self.request.headers.get("content-length", "")
        if is_count(declared) and int(declared) > self.max_bytes:
            raise self.too_large
        boundary = options.get(b"boundary", b"")
        parser = MultiPartParser(self.request.headers, self._capped(b"--" + boundary + b"--"),
                                 max_files=self.max_files, max_fields=self.max_fields)
        try:
            self.form = await parser.parse()
        except MultiPartException as exc:
            raise bad_request(f"malformed multipart body: {exc.message}", None, "invalid_multipart") from None
        if not self.closed:  # cut short: the parser keeps the parts that ended and says nothing
            await self.form.close()
            raise bad_request(f"malformed multipart body: it ends before its closing boundary "
                              f"'--{boundary.decode('latin-1')}--' (cut short?)", None, "invalid_multipart")
        return self.form

    async def __aexit__(self, *exc_info) -> None:
        if self.form is not None:
            await self.form.close()

    async def _capped(self, closing: bytes) -> AsyncIterator[bytes]:
        """The body's chunks, counted against the cap, watching for the ``closing`` delimiter (at
        the body's start, or after a line break, across chunk edges)."""
        seen, tail = 0, b"\r\n"  # the body's start counts as after a line break
        async for chunk in self.request.stream():
            seen += len(chunk)
            if seen > self.max_bytes:
                raise self.too_large
            if not self.closed and chunk:
                window = tail + chunk
                self.closed = b"\r\n" + closing in window
                tail = window[-(len(closing) + 2):]
            yield chunk


def text_fields(form: FormData, files: tuple[str, ...]) -> dict:
    """The form's text fields as a dict for validation, the file parts named in ``files`` left out;
    ``name[]`` repeated fields become lists. A file part under any other name is a 400."""
    out: dict = {}
    for key, value in form.multi_items():
        if key in files:
            continue
        if isinstance(value, UploadFile):
            raise bad_request(f"{key} is a file part; this endpoint takes files only as {', '.join(files)}", key)
        if key.endswith("[]"):
            out.setdefault(key[:-2], []).append(value)
        else:
            out[key] = value
    return out
