"""An input file's lines checked one by one (bad lines become error outcomes, the batch goes on),
and the output and error file lines of what ran."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from batch.store import Line, Outcome
from gateway.schemas import MAX_DEPTH, InvalidJSON, check_shape

_EOL = re.compile(r"\r\n|\r|\n")


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSON-lines text: split at ``\\n``, ``\\r\\n`` and ``\\r`` only. ``str.splitlines``
    also splits at U+2028, U+2029 and U+0085, which a JSON string may hold unescaped (JavaScript's
    ``JSON.stringify`` and ``json.dumps(ensure_ascii=False)`` write them so): a line holding one
    would become two lines of bad JSON."""
    return _EOL.split(text)


def parse_input(content: bytes, endpoint: str) -> tuple[list[Line], list[Outcome]]:
    """The runnable lines of an input file, and an error outcome for each bad one. Blank lines
    are skipped, and a UTF-8 byte order mark before the first (as fine-tuning files take one,
    ``tuning.data``); a line's index is its position in the file (0-based)."""
    lines: list[Line] = []
    invalid: list[Outcome] = []
    seen: set[str] = set()
    text = content.decode("utf-8", errors="replace").removeprefix("\ufeff")  # a BOM (Windows tools write one)
    for index, raw in enumerate(jsonl_lines(text)):
        if raw.strip():
            checked = _check_line(index, raw, endpoint, seen)
            (lines if isinstance(checked, Line) else invalid).append(checked)
    return lines, invalid


def _check_line(index: int, raw: str, endpoint: str, seen: set[str]) -> Line | Outcome:
    def bad(code: str, message: str, custom_id: str | None = None) -> Outcome:
        return error_line(index, custom_id, code, f"line {index + 1}: {message}")

    try:
        check_shape(raw, "the line", MAX_DEPTH + 1)  # its body as a request's: no RecursionError below
        doc = json.loads(raw)
    except InvalidJSON as exc:
        return bad("invalid_json", f"{exc} (a request body may nest {MAX_DEPTH})")
    except ValueError:
        return bad("invalid_json", "not valid JSON")
    if not isinstance(doc, dict):
        return bad("invalid_json", "not a JSON object")
    cid = doc.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return bad("missing_custom_id", "custom_id must be a non-empty string")
    if cid in seen:
        return bad("duplicate_custom_id", f"custom_id {cid!r} is used by an earlier line", cid)
    seen.add(cid)
    if doc.get("method") != "POST":
        return bad("invalid_method", f"method is {doc.get('method')!r}; only POST is supported", cid)
    if doc.get("url") != endpoint:
        return bad("invalid_url", f"url is {doc.get('url')!r}; this batch's endpoint is {endpoint}", cid)
    if not isinstance(doc.get("body"), dict):
        return bad("invalid_body", "body must be a JSON object", cid)
    return Line(index, cid, doc["body"])


def error_line(index: int, custom_id: str | None, code: str, message: str) -> Outcome:
    """An error-file line for a request that got no response (bad line, cancelled, expired)."""
    return Outcome(index, False, {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                                  "response": None, "error": {"code": code, "message": message}})


def response_line(line: Line, status: int, body: Any, request_id: str) -> Outcome:
    """An output-file line (2xx) or error-file line (anything else) for a request that ran."""
    return Outcome(line.index, 200 <= status < 300, {
        "id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None})


def total_usage(outcomes: list[Outcome]) -> dict[str, Any]:
    """A batch's ``usage`` (OpenAI's ``BatchUsage``): the tokens of every response in its output
    file, each line once. Chat and completions count ``prompt_tokens`` / ``completion_tokens``,
    responses ``input_tokens`` / ``output_tokens``, embeddings their ``prompt_tokens``; images and
    speech count none."""
    inp = out = cached = reasoning = 0
    for o in outcomes:
        body = (o.line.get("response") or {}).get("body") if o.ok else None
        u = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(u, dict):
            continue
        inp += int(u.get("input_tokens", u.get("prompt_tokens")) or 0)
        out += int(u.get("output_tokens", u.get("completion_tokens")) or 0)
        cached += int((u.get("input_tokens_details") or u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        reasoning += int((u.get("output_tokens_details") or u.get("completion_tokens_details") or {})
                         .get("reasoning_tokens") or 0)
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": inp + out}
