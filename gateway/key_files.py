"""Tier and admin keys read again from their files while ``tiergate serve`` runs.

A key variable may name a file of keys (``TIERGATE_KEYS_PAID_FILE``, ``gateway.config.env_keys``),
as Docker and Kubernetes mount secrets. When any does, :class:`KeyFiles` reads the keys again

* when a file changes: its path is checked every ``POLL_S`` seconds (modification time, size and
  inode, through symlinks, so a Kubernetes secret's swapped ``..data`` link counts), and read once
  it has stayed the same for one more check (a file being written is not read half-way); and
* at once on ``SIGHUP`` (``kill -HUP <pid>``).

A successful read replaces the server's :class:`~gateway.auth.KeyRing` whole (one assignment on
the event loop: a request is checked against the old ring or the new one, never a mix), so a key
taken out of its file stops working and a key put in starts. A read that fails (a file missing or
unreadable, no tier key left in any file or variable, or a key in two places) changes nothing: the
keys before stay, and the log says why. The log and ``tiergate_key_reloads_total{outcome}`` count reloads; neither
ever shows a key. Variables themselves cannot change in a running process: their keys stay.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily

from gateway.auth import ADMIN_ENV, KeyRing
from gateway.config import KEY_FILE_SUFFIX, ConfigError, check_keys_apart, env_keys, key_variables, tier_keys

if TYPE_CHECKING:
    from gateway.service import Services

log = logging.getLogger("tiergate")

POLL_S = 2.0

_held: list[str] = []  # SIGHUPs that came while the server started (hold_hangups), not yet acted on


def hold_hangups() -> None:
    """From ``tiergate serve``'s first line: a SIGHUP is noted, not the end of the process, until
    the key files' watcher takes it over as it starts (and reads the files again for one that came)
    or :func:`release_hangups` gives it back. Without it a SIGHUP sent while the server imported
    and loaded (seconds) ended it, key files or not."""
    try:
        signal.signal(signal.SIGHUP, _hold)
    except ValueError:  # not the main thread (a server run inside a test)
        pass


def _hold(signum: int, frame: object) -> None:
    _held.append("SIGHUP during start-up")


def drop_hold() -> None:
    """``serve`` ended before the watcher took SIGHUP over (a config refused, Ctrl+C while it
    started): the default back, what was held forgotten (a caller that goes on, as a test, keeps
    no handler of a server that never ran)."""
    try:
        if signal.getsignal(signal.SIGHUP) is _hold:
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
    except ValueError:
        pass
    _held.clear()


def release_hangups() -> None:
    """No key files to read again: SIGHUP's default back (it ends the process, README), and one
    that came while held delivered now."""
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    except ValueError:
        return
    if _held:
        os.kill(os.getpid(), signal.SIGHUP)

Stamp = tuple[tuple[str, int, int, int] | tuple[str, None, None, None], ...]


class KeyFiles:
    """The key files of ``services``' config, watched; see the module docstring."""

    def __init__(self, services: Services, environ: os._Environ[str] | dict[str, str] = os.environ,
                 poll_s: float = POLL_S) -> None:
        self.services = services
        self.environ = environ
        self.poll_s = poll_s
        self.paths = [environ[v + KEY_FILE_SUFFIX] for v in key_variables(services.config)
                      if environ.get(v + KEY_FILE_SUFFIX)]
        self.outcomes = {"reloaded": 0, "failed": 0}
        self._loaded = self._seen = self.stamp()
        self._task: asyncio.Task | None = None

    def stamp(self) -> Stamp:
        """What identifies each file's contents without reading them."""
        out = []
        for path in self.paths:
            try:
                st = os.stat(path)
                out.append((path, st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append((path, None, None, None))
        return tuple(out)

    def reload(self, why: str) -> bool:
        """Read every key variable and file again; on success the server checks keys against
        what they hold from now on."""
        self._loaded = self._seen = self.stamp()
        try:
            keys, admin = tier_keys(self.services.config, self.environ), env_keys(ADMIN_ENV, self.environ)
            if not any(keys.values()):
                raise ConfigError("no tier has a key left")
            check_keys_apart(self.services.config, keys, admin, self.environ)
        except ConfigError as exc:
            self.outcomes["failed"] += 1
            log.error("API keys not reloaded (%s): %s; the keys before stay", why, exc)
            return False
        self.services.keys = KeyRing(keys, admin)
        self.outcomes["reloaded"] += 1
        counts = ", ".join(f"{tier} {len(ring)}" for tier, ring in {**keys, "admin": admin}.items())
        log.info("API keys reloaded (%s): %s", why, counts)
        return True

    def check(self) -> None:
        """One poll: read the files again once a change has stayed for one more poll."""
        now = self.stamp()
        if now != self._loaded and now == self._seen:
            self.reload("a key file changed")
        self._seen = now

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self.reload, "SIGHUP")
        except (RuntimeError, ValueError):  # not the main thread (a server run inside a test)
            log.warning("SIGHUP does not reload the key files here (not the main thread); they are still watched")
        if _held:  # one came while the server started: the keys read then may be older than the files
            _held.clear()
            self.reload("SIGHUP during start-up")
        self._task = asyncio.create_task(self._watch(), name="tiergate-key-files")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)  # (which puts back SIGHUP's default)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # not the end of a process still closing its stores
        except (RuntimeError, ValueError):
            pass

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            self.check()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("tiergate_key_reloads", "API key files read again, by outcome",
                                     labels=["outcome"])
        for outcome, n in self.outcomes.items():
            family.add_metric([outcome], n)
        yield family


def watch_key_files(services: Services, environ: os._Environ[str] | dict[str, str] = os.environ) -> KeyFiles | None:
    """Watch the key files that ``environ`` names for ``services`` (from the app's start to its
    stop); None when it names none."""
    files = KeyFiles(services, environ)
    if not files.paths:
        return None
    services.on_startup.append(files.start)
    services.on_shutdown.append(files.stop)
    services.metrics.registry.register(files)
    return files
