"""Multipart uploads (``multipart/form-data``) as the upload endpoints read them: the body parsed
with Starlette's parser under a byte cap that also stops a body sent without a length, and the
text fields gathered for validation. Used by transcriptions, translations and image edits."""

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
    Content-Length is cut off too; ``param`` names the field the error points at), 400 when it is
    malformed."""

    def __init__(self, request: Request, max_file_bytes: int, expects: str, param: str, max_files: int = 1) -> None:
        self.request = request
        self.max_bytes = max_file_bytes + FORM_SLACK
        self.expects = expects
        self.param = param
        self.max_files = max_files
        self.form: FormData | None = None

    async def __aenter__(self) -> FormData:
        content_type, _ = parse_options_header(self.request.headers.get("content-type", ""))
        if content_type != b"multipart/form-data":
            raise APIError(415, f"this endpoint takes multipart/form-data with {self.expects} "
                                f"(got {content_type.decode('latin-1') or 'no content type'})", "unsupported_media_type")
        declared = self.request.headers.get("content-length", "")
        if is_count(declared) and int(declared) > self.max_bytes:
            raise self._too_large()
        parser = MultiPartParser(self.request.headers, self._capped(), max_files=self.max_files, max_fields=32)
        try:
            self.form = await parser.parse()
        except MultiPartException as exc:
            raise bad_request(f"malformed multipart body: {exc.message}", None, "invalid_multipart") from None
        return self.form

    async def __aexit__(self, *exc_info) -> None:
        if self.form is not None:
            await self.form.close()

    async def _capped(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self.request.stream():
            seen += len(chunk)
            if seen > self.max_bytes:
                raise self._too_large()
            yield chunk

    def _too_large(self) -> APIError:
        limit = self.max_bytes - FORM_SLACK
        return APIError(413, f"the upload is larger than this server's limit of {limit} bytes", "request_too_large",
                        self.param)


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
