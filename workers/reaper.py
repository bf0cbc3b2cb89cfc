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
can be reused), and SIGKILL to those still running ``grace_s`` later; then it removes the folders
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
them. A group, not a session: Linux's scheduler gives each session its own share of the CPU
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
from typing import Iterator

GRACE_S = 5.0  # from SIGTERM to SIGKILL for a guarded process still running
_POLL_S = 0.5  # how often the parent is checked where there is no pidfd

_lock = threading.Lock()
_reaper: subprocess.Popen | None = None
_guarded: set[tuple[int, int]] = set()
_removing: set[str] = set()  # folders handed to the reaper
_groups = 0  # own_group blocks open
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
    with _lock:
        _start(grace_s)
        new = []
        for pid in descendants(os.getpid()):
            started = start_time(pid)
            if pid in before or pid == _reaper.pid or started is None or (pid, started) in _guarded:
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


@contextlib.contextmanager
def own_group() -> Iterator[None]:
    """While open (in any thread), processes ``multiprocessing`` spawns start in a process group of
    their own, in this process's session. Pair it with :func:`guard_new_descendants`: out of the
    group, only the reaper ends them if this process is killed."""
    global _groups

    def spawn_in_own_group(path: bytes, args: list, passfds) -> int:
        shim = [sys.executable, "-I", "-S", "-c", _NEW_GROUP, os.fsdecode(path), *map(os.fsdecode, args)]
        return _spawnv_passfds(os.fsencode(sys.executable), shim, passfds)

    with _lock:
        _groups += 1
        multiprocessing.util.spawnv_passfds = spawn_in_own_group
    try:
        yield
    finally:
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
    alive = [pid for pid, started in guarded.items() if is_same_process(pid, started)]
    for pid in alive:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if is_same_process(pid, guarded[pid])]
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
