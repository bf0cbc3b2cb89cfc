"""The house is drawn in one direction: gateway -> arbiter -> workers -> lora_kernels, with batch
and tuning beside gateway, accounts (imported by both, importing none of them), storage (the SQLite file and
the Redis client that batch and accounts both keep their state in; it imports nothing) and demo
beside them all (demo may import workers and lora_kernels, never the reverse). Checked on every
import statement, lazy ones included, and no module cycle inside a package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "gateway", "batch", "tuning", "accounts", "storage", "arbiter", "workers", "lora_kernels", "demo")
# what each package may import from the others
ALLOWED = {
    "cluster": {"gateway", "batch", "accounts", "storage", "arbiter", "workers", "lora_kernels"},  # the serving stack, per replica
    "gateway": {"batch", "tuning", "accounts", "storage", "arbiter", "workers", "lora_kernels", "demo", "cluster"},  # demo, cluster: their commands
    "batch": {"gateway", "accounts", "storage", "arbiter", "workers", "lora_kernels"},
    "tuning": {"gateway", "batch", "accounts", "storage", "arbiter", "workers", "lora_kernels"},  # fine-tuning, beside batch
    "accounts": {"storage"},  # keys, limits and usage: a leaf the gateway composes
    "storage": set(),  # the SQLite file and Redis client under the stores of batch and accounts
    "arbiter": {"workers"},
    "workers": {"lora_kernels"},
    "lora_kernels": set(),
    "demo": {"workers", "lora_kernels"},
}


def imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in ``path`` (relative imports resolved), except
    under ``if TYPE_CHECKING:`` (annotations only: no import at run time)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for n in ast.walk(block)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def modules(package: str) -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in sorted((ROOT / package).glob("*.py"))}


@pytest.mark.parametrize("package", [p for p in PACKAGES if (ROOT / p).is_dir()])
def test_packages_import_only_downwards(package):
    wrong = []
    for name, path in modules(package).items():
        for target in imports(path):
            top = target.split(".")[0]
            if top in PACKAGES and top != package and top not in ALLOWED[package]:
                wrong.append(f"{name} imports {target}")
    assert wrong == []


@pytest.mark.parametrize("package", [p for p in PACKAGES if (ROOT / p).is_dir()])
def test_no_import_cycle_inside_a_package(package):
    mods = modules(package)
    edges = {m: {t for t in imports(p) if t in mods and t != m} for m, p in mods.items()}
    edges = {m: {t for t in ts if not t.endswith("__init__")} - {package} for m, ts in edges.items()}
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for t in edges.get(m, ()):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join([*trail[trail.index(t):], t]))
            if t not in state:
                visit(t, [*trail, t])
        state[m] = 2

    for m in mods:
        if m not in state:
            visit(m, [m])
