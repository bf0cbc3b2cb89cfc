#!/usr/bin/env python
"""Predicted Outputs on the transformers chat engine: a reply with a prediction against the same
reply without one, on the same worker and model, in one process.

    python scripts/bench_prediction.py               # about half a minute on 2 CPU cores
    python scripts/bench_prediction.py --tokens 96 --rounds 9
    python scripts/bench_prediction.py --smoke       # tiny counts: the code path, no verdict

The engine (``workers.chat.ChatWorker``, placed as the arbiter places it) writes one greedy reply
of ``--tokens`` tokens at a time, read whole, to a prompt whose reply the demo model writes mostly
in its tokenizer's own pieces (so most of a prediction of it can be kept; see README, Predicted
Outputs). Cases, each ``--rounds`` times, their order turned round every round:

  none        no prediction: the baseline
  the reply   the reply's own text: the best case, every token it can keep kept
  an edit     the reply with four characters changed a fifth of the way in: kept up to the change, then
              again from three tokens after it (a re-sync pass of the row's own checks the rest)
  last third  the reply with its last third changed: kept up to the change
  unrelated   text of the same length the reply never writes: nothing kept, and the prefill
              computes the prediction's places for nothing (the worst case)

Judged: in the best case each kept token saves at least half a decode step's time ((none - the
reply) / kept >= 0.5 x none / its decode steps: a kept token is a decode step not run, less the
prefill place it took, a fraction of a step), when at least 8 tokens were kept (else n/a: the demo
model's reply leaves its tokenizer's pieces early); the worst case at most 1.15x slower than none
(its extra prefill places); with an edit a fifth of the way in, at least 0.4 of the time the best case
saves is saved (an edit costs its own tokens and three after it, and a re-sync pass; the demo
model's reply repeats a pair of tokens, so a re-sync may align with the wrong repeat and need a
second one; without re-sync the same run measured 0.32, with it 0.50). Medians of wall time per reply;
the engine's passes (decode steps + re-sync checks) and the kept tokens are printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import Target, at_least, demo_chat_model, judge  # noqa: E402

CHAT = "tiny-chat"
PROMPT = [{"role": "user", "content": "Copy this file."}]
UNRELATED = "The harbour master counts the boats at dawn and writes their names in a ledger. "


async def reply(worker, tokens: int, prediction: str | None) -> tuple[str, float, int, int]:
    """(text, seconds, passes, kept prediction tokens) of one greedy reply; passes: the engine's
    decode steps and re-sync checks."""
    from workers.base import ChatFinished, ChatParams, ChatRequest, TextDelta

    request = ChatRequest(PROMPT, ChatParams(max_tokens=tokens, temperature=0), stream=False, prediction=prediction)
    text, kept, steps, started = [], 0, worker.steps + worker.checks, time.perf_counter()
    async for event in worker.chat(request):
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, ChatFinished):
            kept = event.accepted_prediction_tokens
    return "".join(text), time.perf_counter() - started, worker.steps + worker.checks - steps, kept


async def measure(args: argparse.Namespace) -> dict[str, dict]:
    import torch

    from workers.base import ModelSpec
    from workers.registry import make_worker

    worker = make_worker(ModelSpec(CHAT, "chat", args.model))
    await worker.place(torch.device("cpu"))
    try:
        own, *_ = await reply(worker, args.tokens, None)
        cut, mid = len(own) * 2 // 3, len(own) // 5  # (the demo model keeps to its tokenizer's pieces for ~20 tokens)
        cases = {"none": None, "the reply": own, "an edit": own[:mid] + "#~#~" + own[mid + 4:],
                 "last third": own[:cut] + UNRELATED[: len(own) - cut],
                 "unrelated": (UNRELATED * (len(own) // len(UNRELATED) + 1))[: len(own)]}
        for prediction in cases.values():  # warm: each case's shapes once
            await reply(worker, args.tokens, prediction)
        out: dict[str, dict] = {name: {"seconds": []} for name in cases}
        for r in range(args.rounds):
            for name in (list(cases) if r % 2 == 0 else list(reversed(cases))):
                text, seconds, steps, kept = await reply(worker, args.tokens, cases[name])
                if text != own:
                    raise AssertionError(f"{name}: the reply changed with the prediction")
                out[name]["seconds"].append(seconds)
                out[name].update(steps=steps, kept=kept)
        return out
    finally:
        await worker.release()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "demo-models" / CHAT, help="a chat model folder")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per reply")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="8 tokens, 1 round; no verdict")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.rounds = 8, 1
    import torch

    torch.set_num_threads(1)  # one engine thread's work, as on a shared machine (bench_tiers' reason)
    demo_chat_model(args.model)
    print(f"predicted outputs: {args.model.name} on the transformers engine, CPU, 1 torch thread; one greedy reply "
          f"of {args.tokens} tokens at a time, {args.rounds} rounds, medians")
    result = asyncio.run(measure(args))
    base = statistics.median(result["none"]["seconds"])
    print(f"\n{'prediction':<12} {'ms/reply':>9} {'passes':>7} {'kept':>5} {'none / this':>12}")
    for name, r in result.items():
        ms = statistics.median(r["seconds"]) * 1e3
        print(f"{name:<12} {ms:>9.2f} {r['steps']:>7} {r['kept']:>5} {base * 1e3 / ms:>11.2f}x")
    best, worst = result["the reply"], result["unrelated"]
    step = base / max(result["none"]["steps"], 1)
    saved = (base - statistics.median(best["seconds"])) / max(best["kept"], 1) / step  # in decode steps
    slowdown = statistics.median(worst["seconds"]) / base
    best_saved = base - statistics.median(best["seconds"])
    edit_share = (base - statistics.median(result["an edit"]["seconds"])) / best_saved if best_saved > 0 else 0.0
    why = "" if best["kept"] >= 8 else f"{best['kept']} tokens kept (< 8: the reply left its tokenizer's pieces early)"
    print(f"\na decode step: {step * 1e3:.3f} ms; each kept token saved {saved:.2f} of one")
    targets = [at_least("time a kept token saves, in decode steps", None if why else saved, 0.5, unit="",
                        why_not=why),
               Target("time with an unrelated prediction / without <= 1.15x", f"{slowdown:.2f}x", slowdown <= 1.15),
               at_least("time an edit saves, of what the reply's own text saves", None if why else edit_share,
                        0.4, unit="", why_not=why)]
    return judge(targets, smoke=args.smoke, note="predicted outputs on the transformers engine")


if __name__ == "__main__":
    sys.exit(main())
