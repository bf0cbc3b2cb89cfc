"""Shared fixtures: the tiny demo models (built once per session, offline), a real server, and
one tiergate server on the vLLM engine shared by the modules that test chat through it.

A vLLM engine start is three processes that each import vLLM: about 45 s of CPU on this 2-core
machine. ``test_chat_api`` (its vLLM half), ``test_vllm_gateway`` and ``test_fine_tuning`` share
one such server (``vllm_chat_server``, session-scoped), and when the suite runs in several processes
(pytest-xdist, ``--dist loadfile``) the scheduler below sends the three modules to the same process,
as one unit, so that the server starts once there too. The longest modules go first
(``LONGEST_FIRST``), so that short ones fill in behind them and both processes end together.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers import RunningServer, adapters_yaml, redis_server, start_server, write_config

pytest_plugins = ["tests.timeout_tasks",  # a timeout prints the unfinished asyncio tasks too
                  "tests.loop_stalls"]  # --loop-stalls FILE: the servers' event-loop stalls, as JSON lines

# Modules that must run in the same test process, one after the other (one unit of xdist's
# scheduling): the vLLM three share a session fixture that is costly to start (with
# test_fine_tuning elsewhere, its process started a second vLLM server); the Ray pair (the
# cluster module and the smoke runs, bench_cluster's among them) must not run at the same time,
# as two Ray clusters starve each other on 2 cores (a 3-replica deploy took 170 s with both up).
ONE_PROCESS = {"tests/test_chat_api.py": "vllm-chat-server", "tests/test_vllm_gateway.py": "vllm-chat-server",
               "tests/test_fine_tuning.py": "vllm-chat-server",
               "tests/test_cluster_ray.py": "ray", "tests/test_bench_smoke.py": "ray"}


# The modules that take longest (wall time in two processes on 2 cores: 280 s down to 30 s), in
# that order, then the others in name order: the Ray pair goes to one process and the vLLM pair
# to the other, and short modules fill in behind them so that both processes end together. xdist
# would otherwise order the files by their number of tests (--loadscope-reorder, its default),
# which put these late and left one process running alone.
LONGEST_FIRST = ["test_cluster_ray", "test_bench_smoke", "test_chat_api", "test_vllm_gateway", "test_serve_script",
                 "test_vllm_engine", "test_reaper", "test_fuzz_api", "test_lora_kernels", "test_batches",
                 "test_install_scripts", "test_batch_fill", "test_request_log", "test_operations",
                 "test_fuzz_residency"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.nodeid.partition("::")[0]).stem, len(rank)))  # stable: files stay whole


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the modules of ``ONE_PROCESS`` as one unit each group, handed out
    in the order collected (``LONGEST_FIRST``), a process's next unit when it has one test left."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Grouped(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return ONE_PROCESS.get(module, module)

        def _reschedule(self, node) -> None:
            # xdist sends a process its next unit while two of its tests are left; a process
            # waits for its next test before it runs the current one, so one left is soon
            # enough, and a long next-to-last test (the Ray module's) no longer holds a unit
            # that the other process could run
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    config.option.loadscopereorder = False
    return Grouped(config, log)


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A test that runs ``tiergate serve``'s main() installs its one log handler on the root
    logger; give the next tests the logging they had (pytest's own capture)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("demo-models")


@pytest.fixture(scope="session")
def tiny_chat(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-chat"])["tiny-chat"]


@pytest.fixture(scope="session")
def tiny_image(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-image"])["tiny-image"]


@pytest.fixture(scope="session")
def tiny_tts(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-tts"])["tiny-tts"]


@pytest.fixture(scope="session")
def tiny_stt(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-stt"])["tiny-stt"]


@pytest.fixture(scope="session")
def tiny_embed(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-embed"])["tiny-embed"]


@pytest.fixture(scope="session")
def tiny_moderation(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-moderation"])["tiny-moderation"]


@pytest.fixture(scope="session")
def tiny_softmax(tiny_moderation: Path, tmp_path_factory) -> Path:
    """tiny-moderation as a single-label classifier (a softmax over the categories)."""
    folder = tmp_path_factory.mktemp("softmax") / "tiny-moderation-softmax"
    shutil.copytree(tiny_moderation, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "problem_type": "single_label_classification"}))
    return folder


@pytest.fixture(scope="session")
def tiny_rerank(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-rerank"])["tiny-rerank"]


@pytest.fixture(scope="session")
def tiny_vlm(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-vlm"])["tiny-vlm"]


@pytest.fixture(scope="module")
def chat_server(tiny_chat: Path, tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("chat-server")
    extra = "limits:\n  max_body: 64KiB\n  max_chat_tokens: 64\n"
    server = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat)}, extra))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_chat_server(tiny_chat: Path, demo_dir: Path, tmp_path_factory) -> RunningServer:
    """tiny-chat on the vLLM engine with two adapters (so vLLM runs with LoRA), for
    ``test_chat_api``, ``test_vllm_gateway`` and ``test_fine_tuning``; started once (see the
    module's docstring)."""
    pytest.importorskip("vllm", reason="vllm is not installed in this environment (scripts/test installs it)")
    folder = tmp_path_factory.mktemp("vllm-chat-server")
    (folder / "adapter-dir").mkdir()  # empty: test_vllm_gateway drops adapters in
    cfg = write_config(folder, {"tiny-chat": ("chat", tiny_chat)},
                       adapters_yaml(demo_dir) + "limits:\n  max_chat_tokens: 256\n"
                       f"adapter_dirs:\n  - {{model: tiny-chat, path: {folder / 'adapter-dir'}}}\n"
                       # test_fine_tuning: an adapter trained by peft, served by vLLM
                       "fine_tuning:\n  models: [tiny-chat]\n  lora_rank: 16\n  learning_rate: 0.005\n"
                       "  training_memory: 64MiB\n", engine="vllm")
    cfg.write_text(cfg.read_text().replace("    engine: vllm", "    engine: {name: vllm, kv_cache: 128MiB, max_num_seqs: 8}"))
    server = start_server(cfg)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """A throwaway redis-server for the module's Redis store tests (``helpers.redis_server``)."""
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url
