"""workers.reaper: the processes an engine started end with the serving process, however it ends
(SIGKILL included), and only those. Real processes throughout: a "server" script guards its
children the way the vLLM engine does after its start, and the test kills it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workers import reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")

ROOT = Path(__file__).resolve().parents[1]

# A serving process: one child started before the snapshot (not the engine's: left alone), then
# the "engine's" two, one of which ignores SIGTERM, then guards the new ones and waits.
SERVER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from workers import reaper
    ignore_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    other = subprocess.Popen(["sleep", "120"])
    before = set(reaper.descendants(os.getpid()))
    plain = subprocess.Popen(["sleep", "120"])
    stubborn = subprocess.Popen([sys.executable, "-c", ignore_term])
    time.sleep(0.3)  # the stubborn one has set its handler
    guarded = reaper.guard_new_descendants(before, grace_s=float(sys.argv[1]))
    reaper.remove_when_gone(sys.argv[3])  # as a vLLM engine's start hands over its socket folder
    reaper.remove_when_gone(sys.argv[3])  # as the next engine's start does
    print(json.dumps({"other": other.pid, "plain": plain.pid, "stubborn": stubborn.pid,
                      "guarded": guarded, "reaper": reaper._reaper.pid}), flush=True)
    if sys.argv[2] == "exit":  # a clean shutdown: it stops its engine's processes itself
        for p in (plain, stubborn):
            p.kill(); p.wait()
        other.kill(); other.wait()
        sys.exit(0)
    time.sleep(120)
""")


def start_server(tmp_path: Path, grace_s: float, then: str = "wait", **popen) -> tuple[subprocess.Popen, dict]:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    folder = tmp_path / "sockets"
    folder.mkdir()
    (folder / "engine.sock").touch()
    proc = subprocess.Popen([sys.executable, str(script), str(grace_s), then, str(folder)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, **popen)
    pids = json.loads(proc.stdout.readline())
    return proc, pids


def alive(pid: int) -> bool:
    return reaper.start_time(pid) is not None  # a zombie counts as gone


def wait_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def described(pids: list[int]) -> list[str]:
    """What each of ``pids`` is, for a failure's message: its name, state, parent and command line."""
    out = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            out.append(f"{pid}: gone")
            continue
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        out.append(f"{pid} {stat[stat.index('(') + 1:stat.rindex(')')]!r} state {state} parent {ppid}: {cmd}")
    return out


def cleanup(*pids: int) -> None:
    for pid in pids:
        if pid <= 0:  # os.kill(-1) signals every process this user may signal
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_start_time_tells_the_same_process_from_a_reused_pid():
    proc = subprocess.Popen(["sleep", "30"])
    started = reaper.start_time(proc.pid)
    assert isinstance(started, int) and started > 0
    assert reaper.is_same_process(proc.pid, started)
    assert not reaper.is_same_process(proc.pid, started + 1)  # the pid, but another process
    proc.kill()
    time.sleep(0.1)
    assert reaper.start_time(proc.pid) is None  # exited, not yet waited for: a zombie
    proc.wait()
    assert reaper.start_time(proc.pid) is None


def test_descendants_are_children_and_their_children():
    proc = subprocess.Popen(["bash", "-c", "sleep 30 & wait"])
    own: list[int] = []
    try:
        deadline = time.monotonic() + 5
        while len(reaper.descendants(proc.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        own = reaper.descendants(proc.pid)
        (grandchild,) = own
        assert {proc.pid, grandchild} <= set(reaper.descendants(os.getpid()))
    finally:
        proc.kill()
        proc.wait()
        # this test's own processes only: the worker's other children (a session's vLLM engine
        # core, a redis-server) belong to other tests' fixtures, which killing them broke
        cleanup(*own)


def test_sigkill_of_the_server_ends_the_engine_processes_and_only_them(tmp_path):
    proc, pids = start_server(tmp_path, grace_s=0.5)
    try:
        assert sorted(pids["guarded"]) == sorted([pids["plain"], pids["stubborn"]])
        proc.kill()  # no shutdown runs
        proc.wait()
        # plain ends at the reaper's SIGTERM; stubborn ignores it and gets SIGKILL after 0.5 s
        assert wait_gone([pids["plain"], pids["stubborn"]], within_s=5) == []
        assert wait_gone([pids["reaper"]], within_s=5) == []  # and the reaper is done
        assert alive(pids["other"])  # started before the engine: not the reaper's to end
        assert not (tmp_path / "sockets").exists()  # the folder handed to it, removed
    finally:
        cleanup(pids["other"], pids["plain"], pids["stubborn"], pids["reaper"])


def test_a_signal_to_the_process_group_does_not_end_the_reaper_first(tmp_path):
    """Ctrl+C or systemd signal the whole group: the reaper ignores it and outlives the server."""
    proc, pids = start_server(tmp_path, grace_s=0.5, start_new_session=True)
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and plain end; stubborn ignores it
        proc.wait()
        assert wait_gone([pids["plain"]], within_s=5) == []
        assert wait_gone([pids["stubborn"]], within_s=5) == []  # the reaper's SIGKILL after 0.5 s
        assert wait_gone([pids["reaper"]], within_s=5) == []
    finally:
        cleanup(pids["other"], pids["plain"], pids["stubborn"], pids["reaper"])


def test_a_clean_exit_leaves_nothing_to_reap_and_the_reaper_ends(tmp_path):
    proc, pids = start_server(tmp_path, grace_s=5, then="exit")
    try:
        assert proc.wait(10) == 0
        assert wait_gone([pids["reaper"]], within_s=3) == []
    finally:
        cleanup(pids["other"], pids["plain"], pids["stubborn"], pids["reaper"])


def test_a_guarded_pid_reused_by_another_process_is_not_signalled(tmp_path):
    """The reaper is told a live pid with another start time (what a reused pid looks like)."""
    bystander = subprocess.Popen(["sleep", "30"])
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, subprocess, sys, time
            r = subprocess.Popen([sys.executable, "-I", {str(Path(reaper.__file__))!r}, str(os.getpid()), "0.2"],
                                 stdin=subprocess.PIPE)
            r.stdin.write(b"{bystander.pid} {reaper.start_time(bystander.pid) + 1}\\n"); r.stdin.flush()
            print(r.pid, flush=True)
            time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    reaper_pid = int(parent.stdout.readline())
    try:
        time.sleep(0.2)  # the line is read
        parent.kill()
        parent.wait()
        assert wait_gone([reaper_pid], within_s=5) == []
        assert bystander.poll() is None
    finally:
        cleanup(reaper_pid)
        bystander.kill()
        bystander.wait()


# A serving process killed while an engine starts: what it spawned in its own group (an engine
# core, which starts a worker of its own) is guarded from the spawn on, before any
# guard_new_descendants (which runs once the engine has started).
STARTING_SERVER = textwrap.dedent("""
    import json, multiprocessing, os, subprocess, sys, time
    from workers import reaper

    if __name__ == "__main__":  # the spawned "engine core" imports this module again
        with reaper.own_group():
            core = multiprocessing.get_context("spawn").Process(target=subprocess.call, args=(["sleep", "120"],))
            core.start()
        while not reaper.descendants(core.pid):  # its "worker"
            time.sleep(0.02)
        print(json.dumps({"core": core.pid, "worker": reaper.descendants(core.pid)[0],
                          "reaper": reaper._reaper.pid if reaper._reaper else -1}), flush=True)
        time.sleep(120)
""")


def test_a_server_killed_while_its_engine_starts_leaves_none_of_its_processes(tmp_path):
    """SIGKILL during an engine's start: the engine core, guarded from its spawn on, and the worker
    it started itself (never handed to the reaper) end with the server."""
    script = tmp_path / "starting.py"
    script.write_text(STARTING_SERVER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    pids = json.loads(proc.stdout.readline())
    try:
        proc.kill()
        proc.wait()
        left = wait_gone([pids["core"], pids["worker"]], within_s=reaper.GRACE_S + 5)
        assert left == [], described(left)
        assert pids["reaper"] > 0 and wait_gone([pids["reaper"]], within_s=5) == []
    finally:
        cleanup(pids["core"], pids["worker"], pids["reaper"])


def test_an_abandoned_start_ends_what_it_spawned_and_spawns_no_more():
    """``Spawns.stop``, as a shutdown during an engine's start calls it: the processes the block
    spawned end, with what they started (an engine core's worker), and a later spawn in the block
    (the start going on) is refused. multiprocessing's resource tracker, which this process's
    every spawned process shares, is not the start's to end."""
    import multiprocessing
    from multiprocessing import resource_tracker

    ctx = multiprocessing.get_context("spawn")
    spawns = reaper.Spawns()
    core = worker = None
    try:
        with reaper.own_group(spawns):
            core = ctx.Process(target=subprocess.call, args=(["sleep", "30"],))
            core.start()
            deadline = time.monotonic() + 30
            while not reaper.descendants(core.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            (worker,) = reaper.descendants(core.pid)
            assert list(spawns.started) == [core.pid]
            spawns.stop(grace_s=0.5)
            with pytest.raises(ChildProcessError):
                ctx.Process(target=time.sleep, args=(30,)).start()
        assert wait_gone([core.pid, worker], within_s=3) == []
        assert alive(resource_tracker._resource_tracker._pid)
    finally:
        cleanup(*[p for p in (core and core.pid, worker) if p])
        if core is not None:
            core.join()


ENGINE_SERVER = textwrap.dedent("""
    import asyncio, json, os, sys, time

    async def main():
        from workers import reaper
        from lora_kernels import load_peft_adapter
        from workers.chat_vllm import VllmChatEngine
        from workers.base import ModelSpec

        engine = VllmChatEngine(ModelSpec("tiny-chat", "chat", sys.argv[1], engine="vllm"), max_model_len=256,
                                kv_cache_bytes=64 << 20, dtype="float32", max_num_seqs=2, enforce_eager=True)
        await engine.start()
        stack = tuple((load_peft_adapter(path), weight) for path, weight in ((sys.argv[2], 0.5), (sys.argv[3], -0.7)))
        pids = {"engine": reaper.descendants(os.getpid()), "reaper": reaper._reaper.pid,
                "sockets": os.environ["VLLM_RPC_BASE_PATH"], "stack": engine.stack_lora(stack)[2]}
        print("PIDS", json.dumps(pids), flush=True)
        await asyncio.sleep(600)

    if __name__ == "__main__":  # vLLM spawns its engine core, which imports this module again
        from gateway import request_log
        request_log.configure(json_lines=True)  # as `tiergate serve --log-format json`, before vLLM is imported
        asyncio.run(main())
""")

# vLLM's own log format: "INFO 12-03 06:34:41 [core.py:133] ...", "(EngineCore pid=1) INFO ..."
VLLM_FORMAT = re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d ")


@pytest.fixture(scope="module")
def chat_adapters(demo_dir: Path) -> list[Path]:
    from demo import build_demo_models

    built = build_demo_models(demo_dir, names=["tiny-chat-pirate", "tiny-chat-poet"])
    return [built["tiny-chat-pirate"], built["tiny-chat-poet"]]


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory, tiny_chat, chat_adapters):
    """A serving process with a vLLM engine (and an adapter stack) started, its log in JSON lines:
    one engine start (about 45 s of CPU here) for both tests below. Yields the process, what it
    wrote (stdout and stderr) until its engine had started, and its engine's pids."""
    pytest.importorskip("vllm", reason="scripts/test installs vllm unless TIERGATE_VLLM=0")
    script = tmp_path_factory.mktemp("engine-server") / "engine_server.py"
    script.write_text(ENGINE_SERVER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_RPC_BASE_PATH", "TIERGATE_VLLM_RPC_OWNER", "VLLM_LOGGING_CONFIG_PATH")}
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_chat), *map(str, chat_adapters)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "PYTHONPATH": str(ROOT)}, start_new_session=True)  # a folder of its own
    out = []
    for line in proc.stdout:
        if line.startswith("PIDS "):
            break
        out.append(line)
    else:
        pytest.fail(f"the engine did not start (exit {proc.wait()}):\n" + "".join(out[-50:]))
    pids = json.loads(line[5:])
    try:
        yield proc, out, pids
    finally:
        proc.kill()
        proc.wait()
        cleanup(*pids["engine"], pids["reaper"])


def test_vllm_lines_are_json_lines_in_every_engine_process(engine_server):
    """``--log-format json``: vLLM's loggers, in the serving process and in the engine core and
    worker it spawns, write tiergate's JSON lines (gateway/vllm_logging.json), not vLLM's own
    format, and its weight-loading bar (a terminal's only) is not among them. (Import-time
    warnings of a spawned process come before any configuration, as Python's last-resort text: not
    vLLM's format either; and torch's C++ warnings are not Python's: README, Request logs.)"""
    _, out, _ = engine_server
    assert [line for line in out if VLLM_FORMAT.match(line)] == []
    assert [line for line in out if "checkpoint shards" in line] == []
    loggers = {json.loads(line)["logger"] for line in out if line.startswith("{")}
    assert "vllm.v1.engine.core" in loggers  # the engine core process: "Initializing a V1 LLM engine"
    assert any(name.startswith("vllm.v1.worker.") for name in loggers), loggers  # the worker process
    assert any(name.startswith("vllm.") and name != "vllm.v1.engine.core" and not name.startswith("vllm.v1.worker.")
               for name in loggers)  # and the serving process


def test_the_vllm_engine_processes_end_when_its_server_is_killed(engine_server):
    """vLLM's engine core and worker outlive a SIGKILLed parent on their own (vLLM 0.32); they run
    in a process group of their own, in the server's session. The folder of vLLM's socket files
    goes with them, and so does the folder of the engine's adapter-stack LoRAs."""
    proc, _, pids = engine_server
    engine = [p for p in pids["engine"] if p != pids["reaper"]]
    names = {Path(f"/proc/{p}/comm").read_text().strip() for p in engine}
    assert any(n.startswith("VLLM::EngineCor") for n in names), names  # what vLLM names its core
    # out of the server's group: a Ctrl+C to the group reaches the server alone. In its session:
    # a session of their own is a CPU share of their own (autogroups), which starved the server
    assert all(os.getpgid(p) != os.getpgid(proc.pid) for p in engine)
    assert all(os.getsid(p) == os.getsid(proc.pid) for p in engine)
    sockets = Path(pids["sockets"])  # tiergate's own folder for vLLM's socket files
    assert sockets.name.startswith(f"tiergate-vllm-{proc.pid}-") and any(sockets.iterdir())
    stack = Path(pids["stack"])  # the stack's LoRA folder (named by its content), in the engine's folder of them
    stacks = stack.parent
    assert stacks.name.startswith("tiergate-tiny-chat-stacks-") and stack.is_dir() and any(stack.iterdir())
    proc.kill()
    proc.wait()
    left = wait_gone(engine, within_s=reaper.GRACE_S + 10)
    assert left == [], described(left)  # once (a fresh-clone run, 2026-12-06) one stayed: which, next time
    deadline = time.monotonic() + 10  # the reaper removes them after the engine's processes end
    while (sockets.exists() or stacks.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sockets.exists()  # a killed server never ran its exit, which removes it
    assert not stacks.exists()


def test_own_group_puts_what_multiprocessing_spawns_in_a_group_of_its_own():
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with reaper.own_group():
        inside = ctx.Process(target=time.sleep, args=(30,))
        inside.start()
    outside = ctx.Process(target=time.sleep, args=(30,))
    outside.start()
    try:
        deadline = time.monotonic() + 10  # the shim runs in the child, after start() returned
        while os.getpgid(inside.pid) != inside.pid and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.getpgid(inside.pid) == inside.pid != os.getpgid(0)  # a group leader: the shim ran
        assert os.getsid(inside.pid) == os.getsid(0)  # and still in this session
        assert os.getpgid(outside.pid) == os.getpgid(0)  # restored after the block
        assert multiprocessing.util.spawnv_passfds is reaper._spawnv_passfds
    finally:
        for p in (inside, outside):
            p.kill()
            p.join()


# A server in a terminal with ``stty tostop``: the process it spawns in a group of its own (as a
# vLLM engine core) writes to the terminal from a background group.
TERMINAL = textwrap.dedent("""
    import multiprocessing, termios
    from workers import reaper

    def engine():
        print("the engine wrote", flush=True)

    if __name__ == "__main__":
        attrs = termios.tcgetattr(1)
        attrs[3] |= termios.TOSTOP
        termios.tcsetattr(1, termios.TCSANOW, attrs)
        with reaper.own_group():
            p = multiprocessing.get_context("spawn").Process(target=engine)
            p.start()
        p.join(30)
        print("exit code", p.exitcode, flush=True)
        p.kill()
""")


def test_a_group_of_its_own_still_writes_to_a_terminal_with_tostop_set(tmp_path):
    """Without SIGTTOU ignored, the engine's first write stops it (a background group's write to
    a terminal with tostop set) and it never exits."""
    import pty
    import select

    script = tmp_path / "terminal.py"
    script.write_text(TERMINAL)
    pid, fd = pty.fork()  # the child: a session leader with the new terminal as its controlling one
    if pid == 0:
        try:
            os.execve(sys.executable, [sys.executable, str(script)], {**os.environ, "PYTHONPATH": str(ROOT)})
        finally:
            os._exit(127)  # never go on running pytest in the child
    out, deadline = b"", time.monotonic() + 90
    try:
        while time.monotonic() < deadline:  # until the child has exited and its terminal closed
            if select.select([fd], [], [], 1)[0]:
                try:
                    data = os.read(fd, 4096)
                except OSError:  # the terminal's other side closed
                    break
                if not data:
                    break
                out += data
    finally:
        cleanup(pid)
        os.waitpid(pid, 0)
        os.close(fd)
    assert b"the engine wrote" in out and b"exit code 0" in out, out.decode(errors="replace")[-2000:]


def test_a_tiergate_started_by_another_takes_a_socket_folder_of_its_own(tmp_path):
    """VLLM_RPC_BASE_PATH inherited from a tiergate parent names the parent's folder, which the
    parent removes when it exits: the child makes its own. An operator's folder is kept."""

    def folder_in_child(**env: str) -> Path:
        base = {k: v for k, v in os.environ.items() if k not in ("VLLM_RPC_BASE_PATH", "TIERGATE_VLLM_RPC_OWNER")}
        out = subprocess.run([sys.executable, "-c", "from workers.chat_vllm import _rpc_folder; print(_rpc_folder())"],
                             env={**base, **env}, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
        return Path(out.stdout.strip())

    parents = tmp_path / "parents"
    parents.mkdir()
    child = folder_in_child(VLLM_RPC_BASE_PATH=str(parents), TIERGATE_VLLM_RPC_OWNER="1")
    assert child != parents and child.name.startswith("tiergate-vllm-")
    assert not child.exists()  # the child removed its own folder when it exited
    assert folder_in_child(VLLM_RPC_BASE_PATH=str(tmp_path / "operators")) == tmp_path / "operators"
    assert (tmp_path / "operators").is_dir()  # kept: not tiergate's to remove
