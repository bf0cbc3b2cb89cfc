"""Verdicts for the benchmarks: every ``scripts/bench_*.py`` ends by listing its targets with
the figures measured against them, then ONE last line, its verdict:

    verdict: PASS (2 of 2 judged targets met)
    verdict: FAIL (1 of 3 judged targets missed)
    verdict: n/a on CPU (no device memory)
    verdict: n/a (smoke run: counts too small to judge)

and exits 1 on FAIL, 0 otherwise. A target is judged (PASS/FAIL), not judgeable in this run (n/a,
with the reason), or shown for information only: a target another issue owns, printed with the
figure it would get so nobody has to compute it, but not part of the verdict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SMOKE = "(smoke run: counts too small to judge)"
VERDICT_LINE = re.compile(r"^verdict: (?:(?P<judged>PASS|FAIL)(?: \(.+\))?|n/a \S.*)$")


@dataclass(frozen=True)
class Target:
    claim: str  # what must hold, e.g. "tiergate/broadcast throughput at 1000 waiters >= 10x"
    measured: str  # the figure it was judged on, e.g. "34.8x"
    ok: bool | None  # None: cannot be judged in this run (``why_not`` says why)
    why_not: str = ""  # an n/a reason, written to follow "n/a ": "on CPU (no device memory)"
    judged: bool = True  # False: printed for information (another issue's target), not in the verdict


def at_least(claim: str, value: float | None, target: float, unit: str = "x", why_not: str = "",
             judged: bool = True) -> Target:
    """The common case: ``value >= target``; ``value`` None means not measured (``why_not``)."""
    if value is None:
        return Target(f"{claim} >= {target:g}{unit}", "n/a", None, why_not or "(not measured in this run)", judged)
    return Target(f"{claim} >= {target:g}{unit}", f"{value:.2f}{unit}", value >= target, judged=judged)


def verdict_of(targets: list[Target], smoke: bool = False) -> str:
    """The verdict line for ``targets`` (see the module docstring)."""
    if smoke:
        return f"verdict: n/a {SMOKE}"
    judged = [t for t in targets if t.judged]
    failed = [t for t in judged if t.ok is False]
    passed = [t for t in judged if t.ok is True]
    unknown = [t for t in judged if t.ok is None]
    rest = f", {len(unknown)} n/a" if unknown else ""
    if failed:
        return f"verdict: FAIL ({len(failed)} of {len(passed) + len(failed)} judged targets missed{rest})"
    if passed:
        return f"verdict: PASS ({len(passed)} of {len(passed)} judged targets met{rest})"
    reasons = list(dict.fromkeys(t.why_not for t in unknown)) or ["(no target judged)"]
    return "verdict: n/a " + "; ".join(reasons)


def judge(targets: list[Target], smoke: bool = False, note: str = "") -> int:
    """Print the targets, then the verdict as the last line; return the exit status."""
    print()
    print("targets judged here" + (f" ({note})" if note else "") + ":")
    for t in targets:
        state = "n/a" if t.ok is None or smoke else ("PASS" if t.ok else "FAIL")
        if not t.judged:
            if state == "n/a":
                print(f"  {'info':<5} {t.claim}: n/a" + ("" if smoke else f" {t.why_not}"))
            else:
                print(f"  {'info':<5} {t.claim}: {t.measured} (would {state}; not judged here)")
        elif t.ok is None and not smoke:
            shown = f"{t.measured}, not judged: " if t.measured != "n/a" else ""
            print(f"  {state:<5} {t.claim}: {shown}n/a {t.why_not}")
        else:
            print(f"  {state:<5} {t.claim}: {t.measured}")
    line = verdict_of(targets, smoke)
    print(line, flush=True)
    return 1 if line.startswith("verdict: FAIL") else 0
