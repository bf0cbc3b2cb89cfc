"""Key files read again while the server runs (``gateway.key_files``): a change is read once it
has stayed for one more check, a read replaces the key ring whole, and a read that fails keeps
the keys before. The same on a real ``tiergate serve``, with SIGHUP: tests/test_operations.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway.auth import KeyRing
from gateway.config import load_config
from gateway.key_files import KeyFiles
from tests.helpers import write_config


@pytest.fixture
def setup(tmp_path: Path):
    config = load_config(write_config(tmp_path, {"m": ("chat", tmp_path / "m")}), check_paths=False)
    paid, admin = tmp_path / "paid", tmp_path / "admin"
    paid.write_text("sk-old\n")
    admin.write_text("sk-admin\n")
    environ = {"TEST_KEYS_PAID_FILE": str(paid), "TEST_KEYS_FREE": "sk-free-env", "TIERGATE_KEYS_ADMIN_FILE": str(admin)}
    services = SimpleNamespace(config=config, keys=KeyRing({"paid": ["sk-old"], "free": ["sk-free-env"]}, ["sk-admin"]))
    return SimpleNamespace(files=KeyFiles(services, environ), services=services, paid=paid, admin=admin)


def replace(path: Path, text: str) -> None:
    """Write ``path`` as a secret's update does: a new file renamed over the old one."""
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    os.replace(fresh, path)


def tier_of(setup, key: str) -> str | None:
    caller = setup.services.keys.lookup(key)
    return caller and caller.tier


def test_a_changed_file_is_read_once_it_has_stayed_for_one_more_check(setup):
    assert setup.files.paths == [str(setup.paid), str(setup.admin)]
    setup.files.check()
    ring = setup.services.keys
    replace(setup.paid, "sk-new-1\nsk-new-2\n")
    setup.files.check()  # seen changed: not read yet (it may be half-written)
    assert setup.services.keys is ring and tier_of(setup, "sk-new-1") is None
    setup.files.check()  # the same as the last check: read
    assert tier_of(setup, "sk-new-1") == tier_of(setup, "sk-new-2") == "paid"
    assert tier_of(setup, "sk-old") is None  # taken out of the file: refused from now on
    assert tier_of(setup, "sk-free-env") == "free" and setup.services.keys.lookup("sk-admin").admin
    setup.files.check()
    assert setup.files.outcomes == {"reloaded": 1, "failed": 0}  # once per change


def test_a_file_saved_with_a_utf8_bom_keeps_its_first_key(setup):
    """A key file saved as UTF-8 with a byte order mark (Windows Notepad, PowerShell 5's
    ``-Encoding utf8``) gives every key in it, its first one too, at start and when read again:
    the mark was read as part of the first key, which then got 401 forever (hunt report L, finding 11)."""
    from gateway.config import env_keys

    replace(setup.paid, "\ufeffsk-bom-1\r\nsk-bom-2\r\n")
    assert setup.paid.read_bytes().startswith(b"\xef\xbb\xbfsk-bom-1")
    assert env_keys("TEST_KEYS_PAID", setup.files.environ) == ["sk-bom-1", "sk-bom-2"]
    setup.files.check()
    setup.files.check()
    assert tier_of(setup, "sk-bom-1") == tier_of(setup, "sk-bom-2") == "paid"


def test_a_comment_after_a_key_is_not_part_of_it(setup):
    """``sk-... # alice`` in a key file: the key is what comes before the comment (it took the
    comment in, and the key got 401 forever); whole-line comments and comma lists as before."""
    from gateway.config import env_keys

    replace(setup.paid, "# the team's keys\nsk-alice  # alice\nsk-bob\t# bob, rotated 2026-12\nsk-c1, sk-c2 # both\n")
    assert env_keys("TEST_KEYS_PAID", setup.files.environ) == ["sk-alice", "sk-bob", "sk-c1", "sk-c2"]
    setup.files.check()
    setup.files.check()  # (read once it settled)
    assert tier_of(setup, "sk-alice") == tier_of(setup, "sk-bob") == tier_of(setup, "sk-c2") == "paid"


def test_a_file_rewritten_in_place_between_checks_is_read_when_it_settles(setup):
    setup.paid.write_text("sk-half")
    setup.files.check()
    assert tier_of(setup, "sk-half") is None and tier_of(setup, "sk-old") == "paid"  # never read half-way
    setup.paid.write_text("sk-half-written-then-whole\n")  # a longer write: another stamp
    setup.files.check()
    assert tier_of(setup, "sk-half") is None and tier_of(setup, "sk-old") == "paid"
    setup.files.check()
    assert tier_of(setup, "sk-half-written-then-whole") == "paid" and tier_of(setup, "sk-half") is None


@pytest.mark.parametrize("change", ["remove the file", "empty every tier", "a key in two places"])
def test_a_read_that_fails_keeps_the_keys_before_and_says_why(setup, change, caplog):
    ring = setup.services.keys
    if change == "remove the file":
        setup.paid.unlink()
        reason = f"TEST_KEYS_PAID_FILE: cannot read {setup.paid}"
    elif change == "a key in two places":  # as a tier key too, the admin key would lose its admin rights
        setup.paid.write_text("sk-old\nsk-admin\n")
        reason = (f"a key is listed in both TEST_KEYS_PAID_FILE ({setup.paid}) and "
                  f"TIERGATE_KEYS_ADMIN_FILE ({setup.admin})")
    else:
        setup.files.environ = {**setup.files.environ, "TEST_KEYS_FREE": ""}
        setup.paid.write_text("# no keys now\n")
        reason = "no tier has a key left"
    with caplog.at_level(logging.ERROR, "tiergate"):
        assert setup.files.reload("SIGHUP") is False
    assert setup.services.keys is ring and tier_of(setup, "sk-old") == "paid"
    assert setup.files.outcomes == {"reloaded": 0, "failed": 1}
    assert reason in caplog.text and "the keys before stay" in caplog.text and "sk-admin" not in caplog.text
    setup.files.check()
    setup.files.check()
    assert setup.files.outcomes["failed"] == 1  # not tried again until the file changes again


def test_the_log_and_the_metric_count_reloads_and_never_show_a_key(setup, caplog):
    replace(setup.paid, "sk-secret-rotated\n")
    with caplog.at_level(logging.INFO, "tiergate"):
        assert setup.files.reload("SIGHUP")
    assert "API keys reloaded (SIGHUP): paid 1, subscriber 0, free 1, batch 0, admin 1" in caplog.text
    assert "sk-" not in caplog.text
    [family] = setup.files.collect()
    assert {(s.name, s.labels["outcome"], s.value) for s in family.samples} == {
        ("tiergate_key_reloads_total", "reloaded", 1), ("tiergate_key_reloads_total", "failed", 0)}


def test_tiergate_cluster_stops_at_a_key_file_it_cannot_read_or_a_key_in_two_places(tmp_path, monkeypatch, capsys):
    """The cluster's driver reads the same variables and files (once, at start), before Ray."""
    from cluster.cli import run

    (tmp_path / "m").mkdir()
    config = write_config(tmp_path, {"m": ("chat", tmp_path / "m")})
    monkeypatch.setenv("TEST_KEYS_PAID", "sk-secret-env")
    monkeypatch.setenv("TEST_KEYS_PAID_FILE", str(tmp_path / "missing"))
    assert run(str(config), None, demo=False) == 2
    err = capsys.readouterr().err
    assert f"TEST_KEYS_PAID_FILE: cannot read {tmp_path / 'missing'}" in err and "sk-secret" not in err
    monkeypatch.delenv("TEST_KEYS_PAID_FILE")
    monkeypatch.setenv("TIERGATE_KEYS_ADMIN", "sk-secret-env")  # a key in two places: refused as serve does
    assert run(str(config), None, demo=False) == 2
    err = capsys.readouterr().err
    assert "a key is listed in both TEST_KEYS_PAID and TIERGATE_KEYS_ADMIN" in err and "sk-secret" not in err


def test_a_sighup_while_the_server_starts_is_held_then_read_or_given_back(setup, monkeypatch):
    """``tiergate serve`` holds SIGHUP from its first line: one sent while it imports and loads
    (seconds) ended the process, key files or not. The watcher reads the files as it starts for
    one that came; after it stops, one is not the end of a process still closing its stores; with
    no key files the default (the end of the process) is back, and one held is delivered then
    (hunt report QQ, finding 6)."""
    import asyncio
    import signal

    from gateway import key_files

    before = signal.getsignal(signal.SIGHUP)
    try:
        key_files.hold_hangups()
        replace(setup.paid, "sk-new\n")
        os.kill(os.getpid(), signal.SIGHUP)  # the process's end, before
        assert tier_of(setup, "sk-new") is None  # held: not read until the watcher starts

        async def run() -> None:
            await setup.files.start()
            await setup.files.stop()

        asyncio.run(run())
        assert tier_of(setup, "sk-new") == "paid" and tier_of(setup, "sk-old") is None
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        sent: list[int] = []
        monkeypatch.setattr(key_files.os, "kill", lambda pid, sig: sent.append(sig))
        key_files.hold_hangups()
        key_files.release_hangups()  # none came: nothing delivered
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL and sent == []
        key_files.hold_hangups()
        signal.raise_signal(signal.SIGHUP)
        key_files.release_hangups()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL and sent == [signal.SIGHUP]
    finally:
        signal.signal(signal.SIGHUP, before)
        key_files._held.clear()
