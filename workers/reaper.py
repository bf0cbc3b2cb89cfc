"""The processes an engine starts: out of the serving process's group, and ending with it
however it ends.

vLLM runs its engine core (and, under it, its workers) as child processes. When the process that
started them dies without running its shutdown (SIGKILL, the OOM killer, a crash), they are left
running and keep the device's memory, and a restarted server finds it taken (vLLM 0.32;
vllm-project/vllm#55510). A clean shutdown, SIGTERM included, stops them itself.

The reaper is a small process of its own, started by the serving process at the first
:func:`guard_new_descendants` (Linux only; elsewhere the call does nothing). It reads from a pipe the
processes to guard, each as its pid and its start time, and watches the serving process (a pidfd,
or its parent pid where pidfds are missing). When the serving process is gone, the reaper sends
SIGTERM to each guarded process that is still the same process (same pid, same start time: a pid
can be reused), and to the processes below them (vLLM's workers, under its engine core), and
SIGKILL to those still running ``grace_s`` later; then it removes the folders
handed to it with :func:`remove_when_gone` (vLLM's socket folder, which the serving process
removes at its exit when it gets to run it). It runs in a session of its
own and ignores SIGINT, SIGTERM and SIGHUP: a signal to the serving process's group (Ctrl+C, a
shell's ``kill -- -PGID``) must not end it before the serving process, which it outlives by at
most the grace period.

Process groups. vLLM's engine core stops at once on SIGINT or SIGTERM, so a signal to the serving
process's whole group (Ctrl+C in a terminal, ``kill -- -PGID``) used to cut its streams in flight
(``EngineDeadError``) instead of letting the serving process drain them. Inside :func:`own_group`,
processes that ``multiprocessing`` spawns (vLLM's engine core, and under it its workers) start in a
process group of their own, so such a signal reaches the serving process alone, which drains and
then stops its engines; the reaper is what makes this safe when the serving process cannot stop
them. What :func:`own_group` spawns is guarded from its spawn on, not only once the engine has
started: a server killed while an engine starts leaves none of its processes behind. Handed a
:class:`Spawns`, the block's spawns are also kept there, for the serving process to end them
itself (``Spawns.stop``: an engine start abandoned at shutdown).
A group, not a session: Linux's scheduler gives each session its own share of the CPU
(autogroups), and with the engine core in a session of its own (``setsid``, tried first) the
engine decoded a whole 480-token reply before the serving process delivered its first chunk on
this 2-core machine: streams came in 3-6 bursts instead of 240 chunks, and a paid request arrived
after the batch reply it should have paused had finished. In a terminal the engine's group is a
background group, which ``stty tostop`` stops (SIGTTOU) at its first write to the terminal; the
group's processes ignore SIGTTOU, so their logs are written as before.

This file is also the reaper's program (``python reaper.py PARENT_PID GRACE_S``): standard library only, so
it starts in a few milliseconds and imports nothing of the project.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator

GRACE_S = 5.0  # from SIGTERM to SIGKILL for a guarded process still running
_POLL_S = 0.5  # how often the parent is checked where there is no pidfd

_lock = threading.Lock()
_reaper: subprocess.Popen | None = None
_guarded: set[tuple[int, int]] = set()
_removing: set[str] = set()  # folders handed to the reaper
_groups = 0  # own_group blocks open
_here = threading.local()  # .spawns: the Spawns of the own_group block open in this thread, if any
# multiprocessing's resource tracker, spawned with the first process it starts: this process's for
# every one (it ends once the processes that hold its pipe have), not a start's to end
_TRACKER = "multiprocessing.resource_tracker"
_spawnv_passfds = multiprocessing.util.spawnv_passfds  # what multiprocessing spawns with


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or
    None if there is no such process or it has already exited (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # after the command, which may hold spaces
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped
        return None
    return int(fields[19])


def is_same_process(pid: int, started: int) -> bool:
    """True while ``pid`` is still the process that had start time ``started``."""
    return start_time(pid) == started


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from ``/proc`` (none without it)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def guard_new_descendants(before: set[int], grace_s: float = GRACE_S) -> list[int]:
    """Guard the processes below this one that are not in ``before`` (the pids of
    :func:`descendants` taken before starting them): they are signalled once this process is gone.
    Returns the pids newly guarded."""
    if not sys.platform.startswith("linux"):
        return []
    return _guard([pid for pid in descendants(os.getpid()) if pid not in before], grace_s)


def _guard(pids: list[int], grace_s: float = GRACE_S) -> list[int]:
    """Hand ``pids`` to the reaper (those not yet handed, and not exited); returns those handed."""
    if not sys.platform.startswith("linux"):
        return []
    with _lock:
        _start(grace_s)
        new = []
        for pid in pids:
            started = start_time(pid)
            if pid == _reaper.pid or started is None or (pid, started) in _guarded:
                continue
            _guarded.add((pid, started))
            new.append(pid)
            _reaper.stdin.write(f"{pid} {started}\n".encode())
        _reaper.stdin.flush()
        return new


def remove_when_gone(folder: str, grace_s: float = GRACE_S) -> None:
    """Have the reaper remove ``folder`` (and what it holds) once this process is gone and the
    guarded processes have ended: what this process would remove at exit, had it run its exit."""
    if not sys.platform.startswith("linux"):
        return
    with _lock:
        _start(grace_s)
        if folder not in _removing:
            _removing.add(folder)
            _reaper.stdin.write(f"remove {folder}\n".encode())
            _reaper.stdin.flush()


def _start(grace_s: float) -> None:
    global _reaper
    if _reaper is None or _reaper.poll() is not None:
        _reaper = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), str(grace_s)],
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True,
                                   start_new_session=True)
        _guarded.clear()
        _removing.clear()


# Runs in the spawned process before its program: a group of its own, SIGTTOU ignored (a
# background group's writes to a terminal with tostop set are then written, not stopped; an
# ignored signal stays ignored across exec), then the program itself (same pid, same argv).
# -I -S: no site, no environment; it starts in ~10 ms.
_NEW_GROUP = ("import os, signal, sys; os.setpgid(0, 0); signal.signal(signal.SIGTTOU, signal.SIG_IGN); "
              "os.execv(sys.argv[1], sys.argv[2:])")


class Spawns:
    """The processes an :func:`own_group` block spawned in its thread (vLLM's engine core, which
    starts its workers itself): :meth:`stop` ends them and what they started, and refuses the
    block's later spawns, so that a start abandoned part-way (the server shutting down) ends
    wherever it was, instead of running on to start an engine nobody will use."""

    def __init__(self) -> None:
        self.started: dict[int, int] = {}  # pid -> its start time
        self.stopped = False
        self._lock = threading.Lock()

    def spawn(self, start: Callable[[], int]) -> int:
        with self._lock:  # (a stop meanwhile sees this one, or this one sees the stop)
            if self.stopped:
                raise ChildProcessError("the engine's start was abandoned: nothing more is spawned for it")
            pid = start()
            if (started := start_time(pid)) is not None:
                self.started[pid] = started
            return pid

    def stop(self, grace_s: float = GRACE_S) -> None:
        """(blocking, up to ``grace_s``) End the processes spawned so far and those below them:
        SIGTERM, then SIGKILL for those still running ``grace_s`` later."""
        with self._lock:
            self.stopped = True
            started = dict(self.started)
        _reap(started, grace_s)


@contextlib.contextmanager
def own_group(spawns: Spawns | None = None) -> Iterator[None]:
    """While open (in any thread), processes ``multiprocessing`` spawns start in a process group of
    their own, in this process's session, and are guarded by the reaper from their spawn on (out
    of the group, only the reaper ends them if this process is killed). Pair it with
    :func:`guard_new_descendants` for the processes they start. ``spawns``: the processes this
    thread spawns in the block are kept there too (see :class:`Spawns`)."""
    global _groups

    def spawn_in_own_group(path: bytes, args: list, passfds) -> int:
        shim = [sys.executable, "-I", "-S", "-c", _NEW_GROUP, os.fsdecode(path), *map(os.fsdecode, args)]
        spawns = None if any(_TRACKER in os.fsdecode(a) for a in args) else getattr(_here, "spawns", None)

        def start() -> int:
            return _spawnv_passfds(os.fsencode(sys.executable), shim, passfds)

        pid = start() if spawns is None else spawns.spawn(start)
        _guard([pid])
        return pid

    with _lock:
        _groups += 1
        multiprocessing.util.spawnv_passfds = spawn_in_own_group
    outer, _here.spawns = getattr(_here, "spawns", None), spawns
    try:
        yield
    finally:
        _here.spawns = outer
        with _lock:
            _groups -= 1
            if _groups == 0:
                multiprocessing.util.spawnv_passfds = _spawnv_passfds


# -- the reaper's program --------------------------------------------------------------------------
def _read_lines(fd: int, pending: bytes, guarded: dict[int, int], folders: set[str]) -> tuple[bytes, bool]:
    """Read what the pipe holds now into ``guarded`` ("PID START" lines) and ``folders`` ("remove
    PATH" lines); returns the unfinished line and whether the pipe is closed (every writer gone)."""
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        return pending, False
    if not data:
        return pending, True
    *lines, pending = (pending + data).split(b"\n")
    for line in lines:
        word, rest = line.split(b" ", 1)
        if word == b"remove":
            folders.add(os.fsdecode(rest))
        else:
            guarded[int(word)] = int(rest)
    return pending, False


def _reap(guarded: dict[int, int], grace_s: float) -> None:
    """SIGTERM to the ``guarded`` processes (pid -> start time) still running and to the processes
    below them (an engine core's workers, guarded or not: it may be killed before it could end
    them, or while it starts them), then SIGKILL to those still running ``grace_s`` later."""
    alive = {pid: started for pid, started in guarded.items() if is_same_process(pid, started)}
    for pid in list(alive):
        for below in descendants(pid):
            if (started := start_time(below)) is not None:
                alive[below] = started
    for pid in alive:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = {pid: started for pid, started in alive.items() if is_same_process(pid, started)}
    for pid in alive:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass  # gone meanwhile


def main(parent: int, grace_s: float) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    fd = sys.stdin.fileno()
    guarded: dict[int, int] = {}
    folders: set[str] = set()
    pending, closed = b"", False
    try:
        parent_gone = os.pidfd_open(parent)  # readable once the parent has exited
    except ProcessLookupError:
        parent_gone = None  # gone before this process started
    except (AttributeError, OSError):
        parent_gone = -1  # no pidfds here: poll the parent pid instead
    while parent_gone is not None and os.getppid() == parent:
        watch = ([] if closed else [fd]) + ([parent_gone] if parent_gone >= 0 else [])
        ready = select.select(watch, [], [], None if parent_gone >= 0 else _POLL_S)[0]
        if fd in ready:
            pending, closed = _read_lines(fd, pending, guarded, folders)
        if parent_gone >= 0 and parent_gone in ready:
            break
    os.set_blocking(fd, False)  # what the parent wrote before it went: a process started may
    while not closed:  # hold the pipe's write end, so read what is there, not until its end
        before = len(guarded) + len(folders)
        pending, closed = _read_lines(fd, pending, guarded, folders)
        if len(guarded) + len(folders) == before and not closed:
            break
    _reap(guarded, grace_s)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
