"""Which process made an id that only that process can read back.

Three things live in one server process's memory, named by ids handed to clients: image urls
(``response_format: "url"``, ``img-...``), spoken replies' audio ids (``audio_...``) and realtime
client secrets (``ek_...``). In ``tiergate cluster`` each replica makes its ids with its own
``origin`` (its Serve replica id) after the prefix, ``img-<origin>~<token>``, and the ingress sends
a request that names one to the replica that made it (``origin_of``). ``tiergate serve`` makes
them without one, as before. ``~`` is in neither a url-safe base64 token nor a hex one."""

from __future__ import annotations

SEP = "~"
IMAGE, AUDIO, CLIENT_SECRET = "img-", "audio_", "ek_"  # the prefixes of the three kinds of id


def tagged(prefix: str, origin: str, token: str) -> str:
    """An id: ``prefix``, the origin and ``SEP`` when there is one, then ``token``."""
    return f"{prefix}{origin}{SEP}{token}" if origin else f"{prefix}{token}"


def origin_of(value: object, prefix: str) -> str | None:
    """The origin in ``value`` when it is an id of ``prefix`` made with one; else None."""
    if not isinstance(value, str) or not value.startswith(prefix):
        return None
    origin, sep, _ = value[len(prefix):].partition(SEP)
    return origin if sep and origin else None
