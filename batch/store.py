"""Where the Batch API keeps its files, batches and backlog: one :class:`Store` interface, two
implementations.

* ``batch.sqlite_store.SQLiteStore`` (the default): one file in WAL mode; processes on one machine
  may share it.
* ``batch.redis_store.RedisStore`` (``store: redis://...``): processes on many machines share the
  work through one stream with a consumer group.

Both give the same guarantees, which the runner in ``batch.runner`` relies on:

* A batch's runnable lines enter the backlog in the same atomic step that moves the batch from
  ``validating`` to ``in_progress`` (:meth:`Store.start`), so a crash leaves either no lines or all.
* :meth:`Store.claim` hands each backlog entry to one consumer. An entry that its consumer has not
  touched (:meth:`Store.touch`) for ``reclaim_after_s`` is handed to another: a dead process's
  lines are run again, elsewhere or after a restart.
* Every entry keeps its line's shape (``batch.shapes``: the model and adapter stack it runs on);
  :meth:`Store.shapes` lists the shapes with work, oldest first, and :meth:`Store.claim` can take
  the entries of one shape only, so lines that run together share a model and a stack.
* :meth:`Store.record` writes a line's outcome at most once (the first write wins), counts it, and
  removes the entry from the backlog, all in one atomic step. A line run twice (its first consumer
  was only slow) is therefore recorded once; a crash before the write loses only that attempt.
* :meth:`Store.set_status` is a compare-and-set, so two processes racing to finish (or cancel) a
  batch cannot both win; reaching a terminal status also deletes the batch's working data, its
  entries still in the backlog included (so the lines a cancelled or expired batch never ran do not
  stand before later batches' lines of their shape).

Outcomes are keyed by line index, which is one-to-one with ``custom_id`` for runnable lines (a
duplicate ``custom_id`` is an invalid line); invalid lines, which may have no ``custom_id``, get a
key too. Times are Unix seconds.
"""

from __future__ import annotations

import abc
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from storage import Along

TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
# Batch fields that change after creation (besides status and counts); every store keeps them as JSON.
MUTABLE = ("errors", "output_file_id", "error_file_id", "in_progress_at", "finalizing_at", "completed_at",
           "failed_at", "expired_at", "cancelling_at", "cancelled_at", "model", "usage")


@dataclass(frozen=True)
class FileInfo:
    id: str
    owner: str  # key_id of the key that uploaded it (or of the batch's owner, for outputs)
    purpose: str  # "batch" (uploaded) | "batch_output" (written by a batch) | "assistants" / "user_data" (documents)
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None = None  # gone from then on (``expires_after`` / a batch's ``output_expires_after``)

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


@dataclass
class BatchInfo:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    output_expires_after_s: int | None = None  # its output and error files expire this long after they are written
    requests: int | None = None  # the requests its input holds, where known when it is made (a message batch's)
    status: str = "validating"
    total: int = 0
    completed: int = 0
    failed: int = 0
    fields: dict[str, Any] = field(default_factory=dict)  # the MUTABLE ones that are set

    @property
    def done(self) -> int:
        return self.completed + self.failed

    def static(self) -> dict[str, Any]:
        doc = asdict(self)
        for k in ("status", "total", "completed", "failed", "fields"):
            doc.pop(k)
        return doc

    def public(self) -> dict[str, Any]:
        out = {"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": None,
               "input_file_id": self.input_file_id, "completion_window": self.completion_window,
               "status": self.status, "output_file_id": None, "error_file_id": None,
               "created_at": self.created_at, "in_progress_at": None, "expires_at": self.expires_at,
               "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
               "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
               "metadata": self.metadata, "model": None, "usage": None}
        out.update(self.fields)
        return out


@dataclass(frozen=True)
class Line:
    """A runnable request line of a batch's input file."""

    index: int  # 0-based position in the input file
    custom_id: str
    body: dict[str, Any]
    shape: str = ""  # the model and adapter stack it runs on (``batch.shapes``)


@dataclass(frozen=True)
class Outcome:
    """What became of one line: ``line`` is its output (ok) or error file object."""

    index: int
    ok: bool
    line: dict[str, Any]


@dataclass(frozen=True)
class Job:
    """A backlog entry claimed by one consumer; ``token`` names it to the store."""

    batch_id: str
    line: Line
    token: str
    deliveries: int = 1  # how many times it has been handed out, this time included


@dataclass(frozen=True)
class Recorded:
    new: bool  # False if the line already had an outcome, or the batch has ended
    done: int  # lines of the batch with an outcome
    total: int


class Store(abc.ABC):
    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    # -- files --------------------------------------------------------------------------------
    @abc.abstractmethod
    async def put_file(self, info: FileInfo, content: bytes) -> None:
        """Store (or overwrite, with the same content: outputs are rewritten on a retried finish)."""

    @abc.abstractmethod
    async def get_file(self, file_id: str) -> FileInfo | None: ...

    @abc.abstractmethod
    async def file_content(self, file_id: str) -> bytes | None: ...

    @abc.abstractmethod
    async def delete_file(self, file_id: str) -> bool: ...

    @abc.abstractmethod
    async def list_files(self, owner: str | None, purpose: str | None, after: str | None, limit: int,
                         ascending: bool) -> list[FileInfo] | None:
        """Up to ``limit`` live files by ``(created_at, id)``, newest first unless ``ascending``;
        ``owner`` None lists everyone's, ``purpose`` None every purpose. ``after`` is the last id
        already seen: the page starts past its place, and is None when it names no live file of
        ``owner``'s (one deleted or expired since: the caller starts again)."""

    @abc.abstractmethod
    async def delete_expired_files(self, now: float) -> list[str]:
        """Delete the files whose ``expires_at`` has come (``get_file`` and ``file_content``
        already find none of them); the ids of those that went."""

    # -- batches ------------------------------------------------------------------------------
    @abc.abstractmethod
    async def create_batch(self, batch: BatchInfo) -> None:
        """Store a new batch (status ``validating``) and list it among the open ones."""

    @abc.abstractmethod
    async def get_batch(self, batch_id: str) -> BatchInfo | None: ...

    @abc.abstractmethod
    async def list_batches(self, owner: str | None, after: str | None, limit: int) -> list[BatchInfo]:
        """Newest first; ``owner`` None lists everyone's; ``after`` is the last id already seen."""

    @abc.abstractmethod
    async def delete_batch(self, batch_id: str) -> bool:
        """Delete a batch that has ended (a terminal status: its working data is gone already);
        False, and nothing deleted, for a batch that is not there or has not ended."""

    @abc.abstractmethod
    async def open_batches(self) -> list[str]:
        """Ids of batches not yet in a terminal status."""

    @abc.abstractmethod
    async def start(self, batch_id: str, lines: list[Line], invalid: list[Outcome], now: int) -> bool:
        """``validating`` -> ``in_progress`` with ``lines`` queued and ``invalid`` recorded as
        failed, atomically; False (and nothing written) if the batch was not validating."""

    @abc.abstractmethod
    async def set_status(self, batch_id: str, allowed: Iterable[str], status: str, along: Along | None = None,
                         **fields: Any) -> bool:
        """Compare-and-set: move to ``status`` (setting MUTABLE ``fields``) only from an
        ``allowed`` status. A terminal status also drops the batch's lines, outcomes and backlog
        entries, in the same atomic step; ``along``'s writes (its end's webhook event) are made in
        it too, and only if the status changed."""

    @abc.abstractmethod
    async def lock(self, batch_id: str, holder: str, ttl_s: float) -> bool:
        """Take (or renew) the batch's finishing lock; it lapses after ``ttl_s``."""

    @abc.abstractmethod
    async def unlock(self, batch_id: str, holder: str) -> None: ...

    # -- backlog and outcomes -----------------------------------------------------------------
    @abc.abstractmethod
    async def claim(self, consumer: str, count: int, reclaim_after_s: float, shape: str | None = None) -> list[Job]:
        """Up to ``count`` entries, of ``shape`` only unless it is None: first those idle longer
        than ``reclaim_after_s`` (their consumer went silent), then new ones. Entries of finished
        batches, and of lines that have an outcome (``fill`` gave them one), are dropped here."""

    @abc.abstractmethod
    async def shapes(self, reclaim_after_s: float) -> list[str]:
        """The shapes that have entries to claim, the one with the oldest entry first (a shape
        whose entries are all claimed by live consumers may be listed: claiming it gets none)."""

    @abc.abstractmethod
    async def touch(self, consumer: str, jobs: Iterable[Job]) -> None:
        """Keep ``jobs`` claimed: reset their idle time."""

    @abc.abstractmethod
    async def release(self, consumer: str, jobs: Iterable[Job]) -> None:
        """Give ``jobs`` back unfinished, for anyone to claim at once (a clean shutdown); the
        hand-out does not count as a delivery."""

    @abc.abstractmethod
    async def ack(self, job: Job) -> None:
        """Drop ``job`` from the backlog without an outcome (its batch has stopped)."""

    @abc.abstractmethod
    async def record(self, job: Job, outcome: Outcome) -> Recorded:
        """Write ``job``'s outcome unless it has one, count it, and drop the entry: atomically."""

    @abc.abstractmethod
    async def fill(self, batch_id: str, make: Callable[[Line], Outcome], held_s: float = 0.0) -> int:
        """Record ``make(line)`` for every line that has no outcome yet (cancel, expiry), but those
        a consumer claimed and touched within ``held_s``: they still run, and end on their own
        (recorded, or dropped and filled by a later call). Atomic against ``claim``: a line is
        either held, so left, or filled, so never handed out again."""

    @abc.abstractmethod
    async def outcomes(self, batch_id: str) -> list[Outcome]:
        """Every outcome of the batch, in input order."""


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def outcome_of(index: int, raw: str | bytes) -> Outcome:
    doc = json.loads(raw)
    return Outcome(index, doc["ok"], doc["line"])


def outcome_json(o: Outcome) -> str:
    return dumps({"ok": o.ok, "line": o.line})


def line_json(line: Line) -> str:
    return dumps({"custom_id": line.custom_id, "body": line.body})


def line_of(index: int, raw: str | bytes, shape: str = "") -> Line:
    doc = json.loads(raw)
    return Line(index, doc["custom_id"], doc["body"], shape)


def check_fields(fields: dict[str, Any]) -> None:
    unknown = set(fields) - set(MUTABLE)
    if unknown:
        raise ValueError(f"not a mutable batch field: {sorted(unknown)}")
