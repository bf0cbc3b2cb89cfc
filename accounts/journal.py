"""The usage journal: a SQLite store's usage rows appended to a file first, then folded into the
database by the store's thread (``accounts.sqlite_store``).

A request's usage must be durable before its response's last byte, so that a ``kill -9`` right
after loses none. A SQLite commit gives that at ~30 us of CPU when its code and pages are in the
CPU's caches, but ~150 us when they are not, as between two requests in a server (the WAL
index's locks, ``fcntl`` six times, two page writes); one ``write(2)`` of a line to a file opened
for appending costs ~2 and ~30 us (docs/BENCHMARKS.md, "Gateway overhead"). Both survive the
process the same way: the kernel holds the bytes. (Neither survives the machine's power loss
by itself: in WAL mode with ``synchronous=NORMAL`` only checkpoints sync.)

Files, in the folder ``<database>.usage`` beside the database:

* ``<instance>.lock``: locked (``flock``) by the process that writes ``<instance>``'s segments, for
  as long as it lives. It appears under that name only once locked (made under another name and
  renamed), so a lock file anyone can lock belongs to a process that is gone.
* ``<instance>-<n>.rows``: segments, one JSON array per line ``[day, key, model, tier,
  counters...]``, written by their instance only, on its event loop; a new segment after
  ``SEGMENT_BYTES``. Only whole lines count: a line is one ``write``, and a short one (a full
  disk) is cut off again.

Folding is the store's: in one transaction it reads a segment's folded offset from the
``journal`` table, adds the whole lines after it to their rows and stores the new offset. So any
process may fold any segment (readers fold them all before they read, so usage written by every
process is seen at once), two folds of one segment serialise on the write lock, and a line counts
once. A segment's instance deletes it once it is written whole and folded, then forgets its
offset; the segments of an instance whose process died are folded and deleted by the next process
that opens the store.

A line is positional (``accounts.usage.COUNTERS``' order). New counters are added last, so a shorter
line, written by an older version before an upgrade, is read with its missing counters at 0 (down
to ``FIRST_COUNTERS``); a line of any other width is logged and skipped, not guessed at.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import uuid
from pathlib import Path

SEGMENT_BYTES = 1 << 20  # ~8,000 rows; a segment is deleted once written whole and folded
SUFFIX = ".rows"
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # made once: json.dumps with options makes one per call


class Journal:
    """This process's segments: ``append`` on the event loop (one ``write`` per row), the rest on
    the store's thread."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.instance = uuid.uuid4().hex[:16]
        self.segment: Path | None = None  # the one being written, if any
        self.size = 0  # bytes written to it, whole lines only
        self.appended = 0  # rows appended since opening (the store folds when it moved)
        self.retired: list[Path] = []  # written whole: to fold, then delete
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._seq = 0

    def open(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        making = self.folder / f"{self.instance}.making"
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(making, self.lock_path(self.instance))  # visible only once locked
        self._lock_fd = fd
        self._start_segment()

    def lock_path(self, instance: str) -> Path:
        return self.folder / f"{instance}.lock"

    def _start_segment(self) -> None:
        self._seq += 1
        path = self.folder / f"{self.instance}-{self._seq:06d}{SUFFIX}"
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o600)
        self.segment, self.size = path, 0

    def append(self, row: tuple) -> None:
        """Write ``row`` as one line; it is durable (against this process's death) on return.
        Raises ``OSError`` (nothing of the line left behind) when it cannot be written."""
        if self._fd is None:  # the last segment was written whole (or could not be started)
            if self._lock_fd is None:
                raise RuntimeError("the usage journal is not open")
            self._start_segment()
        line = (_ENCODE(row) + "\n").encode()
        written = os.write(self._fd, line)
        if written != len(line):  # a full disk: leave no piece of a line for the next to join
            os.ftruncate(self._fd, self.size)
            raise OSError(errno.ENOSPC, f"the usage journal took {written} of a row's {len(line)} bytes")
        self.size += written
        self.appended += 1
        if self.size >= SEGMENT_BYTES:
            self.retire()  # the next row starts the next segment

    def retire(self) -> None:
        """Stop writing the current segment: it is whole, to be folded and deleted."""
        if self._fd is not None:
            os.close(self._fd)
            self.retired.append(self.segment)
            self._fd, self.segment = None, None

    def release(self) -> None:
        """After the last fold: the lock file goes, and the lock with it."""
        self.retire()
        if self._lock_fd is not None:
            self.lock_path(self.instance).unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None

    def abandon(self) -> None:
        """Give up the lock but leave the lock file: the next process to open the store finds it
        free and folds and deletes what this one could not."""
        self.retire()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- every process's segments (on the store's thread)
    def segments(self, instance: str | None = None) -> list[Path]:
        """Every segment in the folder (or ``instance``'s), oldest first per instance."""
        return sorted(self.folder.glob(f"{instance or '*'}-*{SUFFIX}"))

    def lock_gone(self) -> list[tuple[str, int]]:
        """The instances whose process is gone, each with its lock file's descriptor, now locked
        here: fold and delete their segments, then ``bury`` them."""
        gone = []
        for path in self.folder.glob("*.lock"):
            instance = path.stem
            if instance == self.instance:
                continue
            try:
                fd = os.open(path, os.O_RDWR)  # never created here: a lock file only its instance makes
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its process lives
                os.close(fd)
                continue
            gone.append((instance, fd))
        for path in self.folder.glob("*.making"):  # a process gone between making its lock file and naming it
            if path.stem != self.instance and _lockable(path):
                path.unlink(missing_ok=True)
        return gone

    def bury(self, instance: str, fd: int) -> None:
        self.lock_path(instance).unlink(missing_ok=True)
        os.close(fd)


def _lockable(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def read_whole_lines(path: Path, start: int, counters: int, fewest: int | None = None) -> tuple[list[tuple], int, int]:
    """The rows (four names, then ``counters`` numbers) of ``path``'s whole lines from byte
    ``start``, the bytes those lines take, and how many lines were not such rows (the caller logs
    them; they are skipped). A row of ``fewest`` to ``counters`` numbers (an older version's) gets
    zeros for the rest. Raises ``FileNotFoundError``."""
    widths = range(4 + (counters if fewest is None else fewest), 4 + counters + 1)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    end = data.rfind(b"\n") + 1
    rows, bad = [], 0
    for line in data[:end].splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if (isinstance(row, list) and len(row) in widths and all(isinstance(v, str) for v in row[:4])
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row[4:])):
            rows.append(tuple(row) + (0,) * (4 + counters - len(row)))
        else:
            bad += 1
    return rows, end, bad
