"""Sum up the event-loop stalls a test run wrote with ``--loop-stalls FILE`` (tests/loop_stalls.py),
by cause and place, the longest total first: count, total and longest lag, and the tests they came in.

    scripts/test --loop-stalls stalls.jsonl && python scripts/loop_stalls.py stalls.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--top", type=int, default=30, help="places to print (default 30)")
    args = parser.parse_args()
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    with open(args.file, encoding="utf-8") as lines:
        for line in lines:
            stall = json.loads(line)
            groups[(stall["cause"], stall["where"] or "-")].append(stall)
    ranked = sorted(groups.items(), key=lambda kv: -sum(s["lag_s"] for s in kv[1]))
    print(f"{'stalls':>6} {'total s':>8} {'max s':>6}  {'cause':<11} where | tests (module: stalls)")
    for (cause, where), stalls in ranked[:args.top]:
        tests = Counter((s["test"] or "-").split("::")[0] for s in stalls).most_common(3)
        print(f"{len(stalls):>6} {sum(s['lag_s'] for s in stalls):>8.2f} {max(s['lag_s'] for s in stalls):>6.2f}  "
              f"{cause:<11} {where} | {', '.join(f'{t}: {n}' for t, n in tests)}")
    print(f"{sum(map(len, groups.values()))} stalls in {len(groups)} places")


if __name__ == "__main__":
    main()
