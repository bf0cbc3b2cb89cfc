"""Every benchmark runs end to end in its ``--smoke`` mode (tiny counts, the real code path) and
ends with a well-formed verdict line whose exit status agrees with it. The figures are not checked:
speed targets live in the benchmarks, never in tests. Plus the verdict rules themselves."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import SMOKE, VERDICT_LINE, Target, at_least, judge, pct, ratio_at_most, scratch_folder, verdict_of  # noqa: E402
from tests.forked import run_script  # noqa: E402


def run_smoke(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python scripts/<script> --smoke args``, forked with the stack imported already
    (``tests/forked.py``: ~5 s of CPU saved a run, the script's own code path unchanged; the
    servers a benchmark starts are started its own way)."""
    with tempfile.TemporaryDirectory(prefix=f"smoke-{script}-") as folder:
        return run_script(ROOT / "scripts" / script, ["--smoke", *args], ROOT, Path(folder), 240)


# Ray's driver prints errors the cluster reports ("(raylet) Task ServeController.graceful_shutdown
# failed ... killed by `ray.kill`", in colour) from a thread of its own, which on a loaded machine
# can come after bench_cluster's verdict: not the benchmark's output, so not its last line.
RAY_NOTICE = re.compile(r"^(\x1b\[[0-9;]*m)?\(raylet\)")


def check_verdict(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stdout.rstrip("\n").splitlines()
    while lines and RAY_NOTICE.match(lines[-1]):
        lines.pop()
    assert lines, f"no output; stderr:\n{proc.stderr[-3000:]}"
    last = lines[-1]
    match = VERDICT_LINE.match(last)
    assert match, f"last line is not a verdict: {last!r}; stderr:\n{proc.stderr[-3000:]}"
    if match["judged"] == "FAIL":
        assert proc.returncode != 0, last
    else:
        assert proc.returncode == 0, f"{last!r} but exit status {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    return last


@pytest.fixture(scope="module", autouse=True)
def cluster_smoke(request, demo_dir: Path, tiny_chat: Path, tmp_path_factory) -> Iterator[subprocess.Popen | None]:
    """bench_cluster's smoke run, started with this module and read by its test, which comes last:
    it mostly waits on Ray (about 25 s of CPU in 55 s), so the other smoke runs go on meanwhile."""
    wanted = any(item.name == "test_smoke_bench_cluster" for item in request.session.items)
    if not wanted or importlib.util.find_spec("ray") is None:
        yield None
        return
    folder = tmp_path_factory.mktemp("cluster-smoke")
    logs = (folder / "stdout").open("w"), (folder / "stderr").open("w")  # files: a pipe nobody reads can fill
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench_cluster.py"), "--smoke", "--models-dir",
                             str(demo_dir)], cwd=ROOT, stdout=logs[0], stderr=logs[1], text=True)
    proc.logs = logs
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in logs:
            f.close()


# The smoke runs that load models keep about one core busy each (bench_tiers: 18.6 s of CPU in 18.0 s)
# while this process waits: two at a time, started with the module, each test reading its own.
MODEL_SMOKES = {
    "bench_swap.py": ("--models-dir", "{demo}", "--device", "cpu"),
    "bench_chat.py": ("--model", "{chat_relative}"),  # as typed in the checkout: the servers' configs are elsewhere
    "bench_tiers.py": ("--models-dir", "{demo}"),
    "bench_overhead.py": ("--models-dir", "{demo}"),
    "bench_batch.py": ("--models-dir", "{demo}"),
    "bench_encoders.py": ("--models-dir", "{demo}"),
    "bench_transcribe.py": ("--models-dir", "{demo}"),
    "bench_realtime.py": ("--models-dir", "{demo}"),
    "bench_decode.py": ("--model", "{chat}"),
    "bench_prediction.py": ("--model", "{chat}"),
    "bench_prefill.py": ("--model", "{chat}"),
    "bench_voice.py": ("--models-dir", "{demo}"),
    "bench_tuning.py": ("--models-dir", "{demo}"),
    "bench_turns.py": ("--models-dir", "{demo}"),
}


@pytest.fixture(scope="module")
def model_smokes(request, demo_dir: Path, tiny_chat: Path, tiny_embed: Path, tiny_stt: Path,
                 tiny_tts: Path) -> Iterator[dict[str, Future]]:
    # the models two smoke runs at once both use are built first: two builds of one folder would race
    wanted = {item.callspec.params["script"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_smoke_with_models"}
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {script: pool.submit(run_smoke, script, *(a.format(demo=demo_dir, chat=tiny_chat,
                                                                 chat_relative=os.path.relpath(tiny_chat, ROOT))
                                                        for a in args))
               for script, args in MODEL_SMOKES.items() if script in wanted}


@pytest.mark.parametrize("script", ["bench_admission.py", "bench_lora_merge.py", "bench_adapters.py", "bench_noise.py"])
def test_smoke_without_models(script: str) -> None:
    assert check_verdict(run_smoke(script)) == f"verdict: n/a {SMOKE}"


@pytest.mark.parametrize("script", list(MODEL_SMOKES))
def test_smoke_with_models(script: str, model_smokes: dict[str, Future]) -> None:
    assert check_verdict(model_smokes[script].result()) == f"verdict: n/a {SMOKE}"


def test_smoke_bench_accounts() -> None:
    assert check_verdict(run_smoke("bench_accounts.py")) == f"verdict: n/a {SMOKE}"


def test_smoke_bench_cluster(cluster_smoke: subprocess.Popen | None) -> None:
    pytest.importorskip("ray.serve")
    assert cluster_smoke is not None
    try:
        cluster_smoke.wait(timeout=240)
    except subprocess.TimeoutExpired:
        cluster_smoke.kill()
        raise
    out, err = (Path(f.name).read_text() for f in cluster_smoke.logs)
    done = subprocess.CompletedProcess(cluster_smoke.args, cluster_smoke.returncode, out, err)
    assert check_verdict(done) == f"verdict: n/a {SMOKE}"


# -- the verdict rules ----------------------------------------------------------------------------

MET = Target("a >= 1x", "2.00x", True)
MISSED = Target("b >= 1x", "0.50x", False)
ON_CPU = Target("c >= 5x", "12x", None, "on CPU (no device memory)")
INFO_MISSED = Target("d >= 1x", "0.70x", False, judged=False)


@pytest.mark.parametrize(
    ("targets", "line"),
    [
        ([MET], "verdict: PASS (1 of 1 judged targets met)"),
        ([MET, ON_CPU], "verdict: PASS (1 of 1 judged targets met, 1 n/a)"),
        ([MET, MISSED], "verdict: FAIL (1 of 2 judged targets missed)"),
        ([MISSED, ON_CPU], "verdict: FAIL (1 of 1 judged targets missed, 1 n/a)"),
        ([ON_CPU, ON_CPU], "verdict: n/a on CPU (no device memory)"),
        ([MET, INFO_MISSED], "verdict: PASS (1 of 1 judged targets met)"),  # another issue's target
        ([INFO_MISSED], "verdict: n/a (no target judged)"),
        ([], "verdict: n/a (no target judged)"),
    ],
)
def test_verdict_of(targets: list[Target], line: str) -> None:
    assert verdict_of(targets) == line
    assert VERDICT_LINE.match(line)


def test_smoke_never_judges() -> None:
    assert verdict_of([MISSED], smoke=True) == f"verdict: n/a {SMOKE}"


def test_at_least() -> None:
    assert at_least("r", 1.5, 1.5).ok is True
    assert at_least("r", 1.49, 1.5).ok is False
    assert at_least("r", None, 1.5, why_not="(not measured)") == Target("r >= 1.5x", "n/a", None, "(not measured)")



def test_pct_reads_whole_percentiles_and_refuses_fractions() -> None:
    xs = [float(i) for i in range(1, 102)]  # 1..101: the q-th percentile is q + 1
    assert (pct(xs, 50), pct(xs, 99), pct(xs, 1)) == (51.0, 100.0, 2.0)
    for fraction in (0.5, 0.99, 50.5, 0, 100):  # 0.5 once read as the last quantile: p99 printed as p50
        with pytest.raises(ValueError):
            pct(xs, fraction)


def test_a_scratch_folder_goes_when_the_run_ends_and_stays_when_it_raises(capsys) -> None:
    with scratch_folder("bench-test-") as clean:
        (clean / "server.log").write_text("ok")
    assert not clean.exists()
    with pytest.raises(RuntimeError), scratch_folder("bench-test-") as failed:
        raise RuntimeError("the server exited")
    assert failed.is_dir() and str(failed) in capsys.readouterr().err
    failed.rmdir()


def test_a_spare_port_is_free_and_below_the_ephemeral_range() -> None:
    """Servers in processes of their own (tests' and benchmarks') get ports no ``bind(0)`` and no
    outgoing connection of another process can take before they bind them: CI once lost a test
    server's port, from ``bind(0)``, in the gap."""
    from benchlib import spare_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {spare_port() for _ in range(20)}
    assert all(p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # chosen at random: two servers started together do not share one


def test_ratio_at_most_judges_the_median_of_the_rounds_ratios(capsys) -> None:
    met = ratio_at_most("a/b p50", "a/b", [1.0, 3.0, 1.1], [1.0, 1.0, 1.0], 1.2)
    assert capsys.readouterr().out == "a/b, per round: 1.00x 3.00x 1.10x\n"
    assert met == Target("a/b p50 <= 1.2x", "1.10x", True)  # the median, not the mean (1.70x) nor the worst
    assert ratio_at_most("a/b p50", "a/b", [2.0, 2.6, 2.8], [2.0, 2.0, 2.0], 1.2).ok is False  # median 1.30x
    assert ratio_at_most("a/b p50", "a/b", [1.0], [1.0], 1.2, "(busy)") == Target("a/b p50 <= 1.2x", "1.00x", None, "(busy)")


@pytest.mark.parametrize("line", ["verdict: PASS!", "verdict: n/a", "verdict: FAIL (", "overall: PASS", "PASS"])
def test_malformed_lines_are_not_verdicts(line: str) -> None:
    assert not VERDICT_LINE.match(line)


def test_judge_prints_the_verdict_last_and_exits_by_it(capsys) -> None:
    assert judge([MET, MISSED]) == 1
    assert judge([MET, ON_CPU]) == 0
    assert judge([ON_CPU]) == 0
    last = capsys.readouterr().out.rstrip("\n").splitlines()[-1]
    assert last == "verdict: n/a on CPU (no device memory)"


def test_other_load_counts_the_benchmarks_own_children_as_ours() -> None:
    """OtherLoad's process-tree walk: a child (and its child) of this process is ours, so a
    benchmark's own server and clients never make its figures n/a; an unrelated process is not."""
    import subprocess

    from benchlib import tree_cpu_s

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                              "print(p.pid, flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        pids = {pid for pid, _ in tree_cpu_s(os.getpid())}
        assert {os.getpid(), child.pid, grandchild} <= pids
        assert 1 not in pids  # init is nobody's child of ours
    finally:
        child.kill()
        os.kill(grandchild, 9)
        child.wait()


def test_other_load_reason_only_above_the_limit() -> None:
    from benchlib import OtherLoad

    quiet, busy = OtherLoad(), OtherLoad()
    quiet.cores, busy.cores = 0.2, 1.3
    assert quiet.why_not() == ""
    assert "1.3 cores" in busy.why_not()
    assert OtherLoad().why_not() == ""  # not measured (not Linux): no reason of its own
