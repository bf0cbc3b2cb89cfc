"""``tiergate serve`` in processes of their own, forked from one that has already imported tiergate.

The tests that need real server processes (``kill -9``, two processes on one store) start about a
dozen of them, and each benchmark's smoke run (``run_script``) is a process of its own too. Each started as ``python -m gateway.cli serve`` spends ~8 s of CPU importing torch,
transformers and tiergate before it reads its config: most of those tests' cost on two cores.
Here a server is forked from multiprocessing's *forkserver*, which imported all of that once (per
test process), so it is ready in ~1 s. It is still a process of its own, with its own pid, memory,
files, signals and exit status, running the same ``gateway.cli.main`` with the same arguments,
environment, working folder and output file. What it skips is only the interpreter's start and
the imports; ``tests/test_serve_script.py`` and ``tests/test_operations.py`` start the real
commands (``scripts/serve``, the ``tiergate`` console script) and keep that path tested.

The forkserver only imports before it forks: no torch op, tokenizer or thread pool has run there,
so it has one thread, and a child inherits no lock another thread held at the fork (torch's
intra-op threads start at the first op); ``tests/test_batches.py`` checks it.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["tests.forked", "gateway.app", "gateway.cli"])


class ForkedServer:
    """The parts of ``subprocess.Popen`` the tests use: ``pid``, ``poll``, ``wait``,
    ``send_signal``, ``terminate`` and ``kill``, with the same meanings (an exit by signal N is
    ``-N``)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> None:
        self.args = ["tiergate", *argv]
        # daemon: if a test process ends with one still running, multiprocessing stops it
        # rather than waiting for it
        self._process = _CONTEXT.Process(target=_serve, args=(argv, env, str(log), str(cwd)), daemon=True,
                                         name=f"tiergate {' '.join(argv)}")
        self._process.start()
        self.pid = self._process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that may have been reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _serve(argv: list[str], env: dict[str, str], log: str, cwd: str) -> None:
    """The forked process: what ``python -m gateway.cli <argv>`` with ``env``, ``cwd`` and its
    output to ``log`` would do once imported."""
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["tiergate", *argv]
    import torch

    # OMP_NUM_THREADS is read when torch is imported, which here was in the forkserver
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    from gateway.cli import main

    try:
        code = main(argv)
    finally:
        # what the interpreter's exit runs (logging's last lines among them); multiprocessing
        # ends its children with os._exit, which skips it
        atexit._run_exitfuncs()
    sys.exit(code)


def run_script(script: Path, argv: list[str], cwd: Path, folder: Path, timeout: float) -> subprocess.CompletedProcess:
    """What ``subprocess.run([sys.executable, script, *argv], cwd=cwd, capture_output=True,
    text=True, timeout=timeout)`` gives, the script run in a process forked here (as
    ``python script``: ``__main__``, its folder first on ``sys.path``, this environment), its
    output through files in ``folder`` (a pipe nobody reads can fill)."""
    out, err = folder / "stdout", folder / "stderr"
    # not a daemon: a benchmark may start processes of its own (bench_tiers' flood client), which
    # a daemon may not; it is joined or killed here either way
    process = _CONTEXT.Process(target=_script, args=(str(script), argv, dict(os.environ), str(out), str(err), str(cwd)),
                               name=f"python {script.name}")
    process.start()
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise subprocess.TimeoutExpired([sys.executable, str(script), *argv], timeout, out.read_text(), err.read_text())
    return subprocess.CompletedProcess([sys.executable, str(script), *argv], process.exitcode, out.read_text(),
                                       err.read_text())


def _script(script: str, argv: list[str], env: dict[str, str], out: str, err: str, cwd: str) -> None:
    """The forked process: ``python script argv`` once imported (see ``run_script``)."""
    import runpy

    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CREAT, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))  # as in _serve
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def threads_and_imports(answers) -> None:
    """For the test of this module, from a process forked here: the threads of the forkserver it
    was forked from (a fork copies only the forking thread, so any other one running there could
    have held a lock the child then finds held forever), and which of the stack's modules the
    child has (this module imports none of them itself)."""
    answers.put((len(os.listdir(f"/proc/{os.getppid()}/task")),
                 sorted(m for m in ("torch", "transformers", "gateway.app") if m in sys.modules)))
