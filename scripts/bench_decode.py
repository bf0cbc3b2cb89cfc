#!/usr/bin/env python
"""The chat engine's decode step on CUDA: attention as tiergate runs it (cuDNN taken out of
torch's attention kernels when a worker is placed on CUDA, ``workers.worker.keep_cudnn_out_of_attention``)
against torch's own order (cuDNN first for attention with a mask on Hopper and newer GPUs), on the
same worker and model, in one process.

    python scripts/bench_decode.py                  # on a CUDA machine, about a minute
    python scripts/bench_decode.py --rows 4 --tokens 300 --model demo-models/tiny-chat
    python scripts/bench_decode.py --stream --tokens 400   # streamed replies: their text every step
    python scripts/bench_decode.py --smoke          # tiny counts, any device: the code path, no verdict

The transformers engine (``workers.chat.ChatWorker``, placed with ``Worker.place`` as the arbiter
places it) serves ``--rows`` concurrent greedy chat requests of ``--tokens`` tokens each; the figure
is wall time per decode step (the engine's own step counter), so it holds the forward pass, the
attention mask, sampling and the engine's Python, as a server's step does. Runs, in this order:

  shipped                 cuDNN out of attention (as placed)
  torch order, new shapes cuDNN back in (``torch.backends.cuda.enable_cudnn_sdp(True)``) for the
                          first time in the process: every step meets a (rows, key length) cuDNN has
                          not planned for, as a server's steps keep doing
  torch order, same again the same requests once more: cuDNN's plans for those shapes are cached
  shipped                 again; its figure is the mean of its two runs
(after a warm-up run of the same requests, shipped).

Judged on CUDA: shipped ms per step <= torch's order on new shapes (1.0x). The cached row is
shown, not judged: a server seldom meets the same shapes again. On the CPU it is n/a: cuDNN does
not run there, so the two orders are the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import Target, demo_chat_model, judge  # noqa: E402

CHAT = "tiny-chat"


async def run(worker, rows: int, tokens: int, words: int, stream: bool = False) -> tuple[float, int]:
    """``rows`` concurrent greedy requests of ``tokens`` each, their prompts ``words`` words long,
    streamed or read whole: (seconds, decode steps the engine ran)."""
    from workers.base import ChatParams, ChatRequest

    async def one(n: int) -> None:
        prompt = " ".join(["story"] * words) + f" {n}"
        request = ChatRequest([{"role": "user", "content": prompt}], ChatParams(max_tokens=tokens, temperature=0),
                              stream=stream)
        async for _event in worker.chat(request):
            pass

    steps, started = worker.steps, time.perf_counter()
    await asyncio.gather(*(one(n) for n in range(rows)))
    return time.perf_counter() - started, worker.steps - steps


async def measure(args: argparse.Namespace, device) -> dict[str, float]:
    import torch

    from workers.base import ModelSpec
    from workers.registry import make_worker

    worker = make_worker(ModelSpec(CHAT, "chat", args.model, options={"max_num_seqs": args.rows}))
    await worker.place(device)
    cuda = device.type == "cuda"
    shipped = torch.backends.cuda.cudnn_sdp_enabled()
    ms: dict[str, list[float]] = {}

    async def timed(label: str, words: int, cudnn: bool) -> None:
        torch.backends.cuda.enable_cudnn_sdp(cudnn if cuda else shipped)
        seconds, steps = await run(worker, args.rows, args.tokens, words, args.stream)
        ms.setdefault(label, []).append(seconds / max(steps, 1) * 1e3)
        print(f"  {label:<26} {steps:>5} steps in {seconds:6.2f} s", flush=True)

    try:
        await run(worker, args.rows, args.tokens, 4, args.stream)  # warm: the engine's first steps and allocations
        await timed("shipped", 4, shipped)
        await timed("torch order, new shapes", 4, True)  # cuDNN's first run: no shape planned yet
        await timed("torch order, same again", 4, True)
        await timed("shipped", 4, shipped)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(shipped)
        await worker.release()
    return {label: sum(v) / len(v) for label, v in ms.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "demo-models" / CHAT, help="a chat model folder")
    ap.add_argument("--rows", type=int, default=8, help="concurrent requests (the engine's width)")
    ap.add_argument("--tokens", type=int, default=150, help="tokens per request")
    ap.add_argument("--device", default="auto", help="auto (CUDA where it exists), cuda or cpu")
    ap.add_argument("--stream", action="store_true", help="streamed requests (their text decoded every step), "
                    "not replies read whole (decoded at their end)")
    ap.add_argument("--smoke", action="store_true", help="2 rows x 6 tokens; no verdict")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.tokens = 2, 6

    import torch

    from arbiter.footprint import default_device

    device = default_device() if args.device == "auto" else torch.device(args.device)
    demo_chat_model(args.model)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no cuDNN: both orders are the same code)"
    print(f"chat engine decode step: {args.model.name}, {args.rows} rows x {args.tokens} tokens, greedy, "
          f"{'streamed' if args.stream else 'read whole'}; "
          f"device {device} ({where}); torch {torch.__version__}")
    result = asyncio.run(measure(args, device))
    base = result["torch order, new shapes"]
    print(f"\n{'attention kernels':<26} {'ms/step':>9} {'vs torch order, new shapes':>28}")
    for label, value in result.items():
        print(f"{label:<26} {value:>9.2f} {value / base:>27.2f}x")
    ratio = result["shipped"] / base
    claim = "shipped ms per decode step / torch's order on new shapes <= 1.0x"
    again = result["shipped"] / result["torch order, same again"]
    cuda = device.type == "cuda"
    targets = [Target(claim, f"{ratio:.2f}x", ratio <= 1.0 if cuda else None, "on CPU (cuDNN does not run there)"),
               Target("shipped / torch's order on shapes it has planned before (cached) <= 1.0x", f"{again:.2f}x",
                      again <= 1.0 if cuda else None, "on CPU (cuDNN does not run there)", judged=False)]
    return judge(targets, smoke=args.smoke, note="the chat engine's attention kernels on CUDA")


if __name__ == "__main__":
    sys.exit(main())
