#!/usr/bin/env python
"""ONE prepared GPU check of the workers: each modality's worker loaded on CUDA, one real request
through its public call, compared with the same worker on CPU (no gateway, vLLM or network needed:
torch, transformers, diffusers, peft, soundfile and the demo models are):

    python scripts/gpu_check_workers.py [--models demo-models] [--device cuda] [--out DIR]

Per worker: where its weights are after ``load`` (all on the device, in the dtype the worker picks
there: bf16 chat, fp16 image, fp32 otherwise), the seconds of a second (warm) call on the device,
and how far the device's result is from the CPU's:

  chat        logits of one prompt (rel. max error), and a greedy reply streamed by ``chat``
              with and without an adapter stack (pirate 0.5 + poet -0.7, merged by
              lora_kernels: Triton on CUDA); equal replies are reported, not required (bf16);
              then three prompts of different lengths prefilled in one shared, left-padded pass
              (the engine's ``_prefill_together``): the cache it leaves must be finite (a padded
              place that attends to nothing must not put NaN in it), and each first token is
              compared with the prompt's own pass on the device (equal ones reported)
  vision      tiny-vlm (LLaVA): logits of one prompt with an image (rel. max error), its pixels
              in the model's dtype on the device, and a greedy reply to it streamed by ``chat``
  image       3 denoising steps at 32x32, seed 1, with and without the sketch adapter: max
              pixel difference (the worker draws the noise on a CPU generator, so it is the
              same); then the bare pipeline in fp32 and in fp16 on both devices, to tell a
              difference of dtype from one of device kernels
  tts         one sentence: samples and loudness (RMS) of each (VITS draws noise: no sample match)
  stt         a 3 s tone: the text and language, equal or not
  embed       cosine similarity of the vectors (min over the inputs)
  moderation  max |score difference|
  rerank      max |score difference| of (query, document) pairs, a long document in pieces among them
  train       the fine-tuning trainer: 30 optimizer steps teaching one answer (seed 1) on the
              device (bf16 weights, fp32 LoRA factors) and on CPU; its first and last loss on
              each, and the taught reply greedy through peft on the device; then 10 DPO steps
              (beta 0.5) on the device preferring that answer to another: first and last loss

Checks that must hold (exit 1 otherwise): every weight on the device, every call completes and
returns a well-formed result, embeddings' cosine >= 0.999, moderation and rerank scores within 1e-3
(fp32 on both sides), chat and vision logits within 5% of their scale (bf16 against fp32), the
trainer's last loss below its first on the device, DPO's too, its first log 2 (the LoRA starts at
zero: the tuned model is the reference). Writes
workers.json to --out. ``--device cpu`` runs the same path on CPU against CPU (a dry run).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from workers.base import ChatFinished, ChatParams, ChatRequest, ModelSpec, StepContext, TextDelta  # noqa: E402

CPU = torch.device("cpu")


def on_device(worker, device: torch.device) -> tuple[bool, list[str]]:
    tensors = [t for m in worker.modules() for t in (*m.parameters(), *m.buffers())]
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()})
    return bool(tensors) and all(t.device.type == device.type for t in tensors), dtypes


def timed(fn):
    fn()  # first call: kernels, caches
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def pair(cls, spec: ModelSpec, device: torch.device, **kw):
    cpu, dev = cls(spec, **kw), cls(spec, **kw)
    cpu.load(CPU)
    dev.load(device)
    return cpu, dev


async def _reply(worker, content: str, adapters=()) -> str:
    req = ChatRequest([{"role": "user", "content": content}], ChatParams(max_tokens=12, temperature=0),
                      ctx=StepContext(), adapters=adapters)
    parts, fin = [], None
    async for ev in worker.chat(req):
        if isinstance(ev, TextDelta):
            parts.append(ev.text)
        elif isinstance(ev, ChatFinished):
            fin = ev
    assert fin is not None and fin.completion_tokens > 0, f"no finish or no tokens: {fin}"
    return "".join(parts)


def check_chat(models: Path, device: torch.device) -> dict:
    from lora_kernels import load_peft_adapter
    from workers.chat import ChatWorker

    cpu, dev = pair(ChatWorker, ModelSpec("tiny-chat", "chat", models / "tiny-chat"), device)
    placed, dtypes = on_device(dev, device)
    ids = cpu.encode([{"role": "user", "content": "Tell me about the sea."}])
    with torch.inference_mode():
        ref = cpu.model(torch.tensor([ids])).logits.float()
        got = dev.model(torch.tensor([ids], device=device)).logits.float().cpu()
    rel = float((got - ref).abs().max() / ref.abs().max())
    stack = ((load_peft_adapter(models / "adapters" / "tiny-chat-pirate"), 0.5),
             (load_peft_adapter(models / "adapters" / "tiny-chat-poet"), -0.7))
    replies = {}
    for label, adapters in (("base", ()), ("stack", stack)):
        want = asyncio.run(_reply(cpu, "Tell me about the sea.", adapters))
        got_text, seconds = timed(lambda: asyncio.run(_reply(dev, "Tell me about the sea.", adapters)))
        replies[label] = {"equal": got_text == want, "seconds": seconds, "chars": len(got_text)}
    together = _prefilled_together(dev, ["Tell me about the sea.", "Hi", "Where do the ships go in winter, captain?"])
    return {"placed": placed, "dtypes": dtypes, "logits_rel_err": rel, "replies": replies, "together": together,
            "ok": placed and rel <= 0.05 and all(r["chars"] > 0 for r in replies.values()) and together["finite"]}


def _prefilled_together(worker, prompts: list[str]) -> dict:
    """Prompts prefilled in one shared pass by the engine's own ``_prefill_together`` (called from
    here while its thread waits for work, as tests/test_chat_worker.py calls ``_admit``): whether
    the batch cache it leaves is finite, and how many first tokens equal the prompt's own pass."""
    from workers.chat import _Batch, _Seq

    seqs = []
    for i, text in enumerate(prompts):
        ids = worker.encode([{"role": "user", "content": text}])
        seqs.append(_Seq(ids=ids, prompt_len=len(ids), params=ChatParams(max_tokens=4, temperature=0),
                         emit=lambda ev: None, req=ChatRequest([], ChatParams(), ctx=StepContext()),
                         generator=torch.Generator(), arrival=i))
    alone = []
    with torch.inference_mode():
        for seq in seqs:
            alone.append(int(worker.model(torch.tensor([seq.ids], device=worker.device)).logits[0, -1].argmax()))
    saved, worker._waiting = worker._waiting, list(seqs)
    batch = _Batch()
    try:
        worker._prefill_together(batch, seqs)
    finally:
        worker._waiting = saved
    layers = list(batch.cache.layers) if batch.cache is not None else []
    finite = bool(layers) and all(bool(torch.isfinite(x.keys).all() and torch.isfinite(x.values).all()) for x in layers)
    return {"rows": len(batch.seqs), "finite": finite,
            "first_tokens_equal": sum(seq.ids[seq.prompt_len] == a for seq, a in zip(seqs, alone))}


def check_train(models: Path, device: torch.device) -> dict:
    import tempfile

    from peft import PeftModel
    from workers.trainer import LoraTrainer, Pair, TrainRun, encode_example

    spec = ModelSpec("tiny-chat~train", "train", models / "tiny-chat")
    cpu, dev = pair(LoraTrainer, spec, device)
    placed, dtypes = on_device(dev, device)
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Arr, matey!"}]
    losses = {}
    for label, worker in (("cpu", cpu), ("device", dev)):
        out = Path(tempfile.mkdtemp())
        example = encode_example(worker.tokenizer, messages, None, 512)
        reports: list[dict] = []
        start = time.perf_counter()
        worker.train(TrainRun([example] * 3, [], 30, 3, 0.01, 1, 16, 32, out), StepContext(), reports.append)
        steps = [r["train_loss"] for r in reports if "checkpoint" not in r]
        losses[label] = {"first": steps[0], "last": steps[-1], "seconds": time.perf_counter() - start}
    tuned = PeftModel.from_pretrained(dev.model, out / "step-30").to(device)
    ids = dev.tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True).to(device)
    reply = dev.tokenizer.decode(tuned.generate(**ids, max_new_tokens=8, do_sample=False)[0, ids["input_ids"].shape[1]:],
                                 skip_special_tokens=True)
    tuned.unload()  # the trainer's weights as they were, for DPO
    pair_ = Pair(*(encode_example(dev.tokenizer, [messages[0], {"role": "assistant", "content": a}], None, 512)
                   for a in ("Arr, matey!", "Hello there.")))
    reports = []
    dev.train(TrainRun([pair_] * 3, [], 10, 3, 0.01, 1, 16, 32, Path(tempfile.mkdtemp()), beta=0.5), StepContext(),
              reports.append)
    dpo = [r["train_loss"] for r in reports if "checkpoint" not in r]
    return {"placed": placed, "dtypes": dtypes, "losses": losses, "reply": reply,
            "dpo": {"first": dpo[0], "last": dpo[-1]},
            "ok": placed and losses["device"]["last"] < losses["device"]["first"]
            and abs(dpo[0] - math.log(2)) < 1e-3 and dpo[-1] < dpo[0]}


def check_vision(models: Path, device: torch.device) -> dict:
    from PIL import Image

    from workers import chat_prompt
    from workers.chat import ChatWorker

    cpu, dev = pair(ChatWorker, ModelSpec("tiny-vlm", "chat", models / "tiny-vlm"), device)
    placed, dtypes = on_device(dev, device)
    rng = np.random.default_rng(0)
    png = io.BytesIO()
    Image.fromarray((rng.random((40, 50, 3)) * 255).astype("uint8")).save(png, "PNG")

    def req() -> ChatRequest:
        return ChatRequest([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
                           ChatParams(max_tokens=12, temperature=0), ctx=StepContext(), images=(png.getvalue(),))

    ids, vision = chat_prompt.vision_inputs(cpu.processor, req(), cpu.context_length)
    with torch.inference_mode():
        ref = cpu.model(input_ids=torch.tensor([ids]), **vision).logits.float()
        seq = type("Row", (), {"vision": vision})()  # what ChatWorker._vision reads of a row
        got = dev.model(input_ids=torch.tensor([ids], device=device), **dev._vision(seq)).logits.float().cpu()
    rel = float((got - ref).abs().max() / ref.abs().max())

    async def reply(worker) -> str:
        parts = [ev.text async for ev in worker.chat(req()) if isinstance(ev, TextDelta)]
        return "".join(parts)

    want = asyncio.run(reply(cpu))
    got_text, seconds = timed(lambda: asyncio.run(reply(dev)))
    return {"placed": placed, "dtypes": dtypes, "logits_rel_err": rel,
            "reply": {"equal": got_text == want, "seconds": seconds, "chars": len(got_text)},
            "ok": placed and rel <= 0.05 and len(got_text) > 0}


def check_image(models: Path, device: torch.device) -> dict:
    from PIL import Image

    from lora_kernels import load_diffusers_lora
    from workers.image import ImageRequest, ImageWorker

    cpu, dev = pair(ImageWorker, ModelSpec("tiny-image", "image", models / "tiny-image"), device)
    placed, dtypes = on_device(dev, device)
    sketch = load_diffusers_lora(models / "adapters" / "tiny-image-sketch")
    out = {"placed": placed, "dtypes": dtypes}
    ok = placed
    for label, adapters in (("base", ()), ("sketch", ((sketch, 0.8),))):
        req = ImageRequest("a lighthouse at night", width=32, height=32, seed=1, num_inference_steps=3,
                           adapters=adapters)
        (want,) = cpu.generate(req, StepContext())
        (got,), seconds = timed(lambda: dev.generate(req, StepContext()))
        a, b = (np.asarray(Image.open(io.BytesIO(p)).convert("RGB"), dtype=np.int16) for p in (want, got))
        ok &= a.shape == b.shape == (32, 32, 3)
        out[label] = {"max_pixel_diff": int(np.abs(a - b).max()), "mean_pixel_diff": float(np.abs(a - b).mean()),
                      "seconds": seconds}
    # where a difference comes from: the same pipeline call on both devices in one dtype
    for dtype in (torch.float32, torch.float16):
        a, b = (_pipeline_pixels(models / "tiny-image", d, dtype) for d in (CPU, device))
        out[f"same_dtype_{str(dtype).removeprefix('torch.')}"] = {"max_pixel_diff": float(np.abs(a - b).max()),
                                                                  "mean_pixel_diff": float(np.abs(a - b).mean())}
    out["ok"] = bool(ok)
    return out


def _pipeline_pixels(path: Path, device: torch.device, dtype: torch.dtype) -> np.ndarray:
    """The worker's pipeline call (3 steps, 32x32, guidance 7, a CPU generator seeded 1) in
    ``dtype`` on ``device``: pixels 0-255 as floats."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        img = pipe("a lighthouse at night", height=32, width=32, num_inference_steps=3, guidance_scale=7.0,
                   generator=torch.Generator("cpu").manual_seed(1), output_type="np").images[0]
    return img.astype(np.float64) * 255


def check_tts(models: Path, device: torch.device) -> dict:
    from workers.tts import SpeechRequest, TTSWorker

    cpu, dev = pair(TTSWorker, ModelSpec("tiny-tts", "tts", models / "tiny-tts"), device)
    placed, dtypes = on_device(dev, device)
    req = SpeechRequest("Hello from the device.")
    want = np.concatenate(list(cpu.synthesize(req, StepContext())))
    got, seconds = timed(lambda: np.concatenate(list(dev.synthesize(req, StepContext()))))
    rms = [float(np.sqrt(np.mean(np.square(a)))) for a in (want, got)]  # VITS samples its noise: no sample-wise match
    return {"placed": placed, "dtypes": dtypes, "samples": [len(want), len(got)], "rms": rms,
            "seconds": seconds, "ok": placed and len(got) > 0 and bool(np.isfinite(got).all())}


def check_stt(models: Path, device: torch.device) -> dict:
    from workers.stt import STTWorker, TranscriptionRequest

    cpu, dev = pair(STTWorker, ModelSpec("tiny-stt", "stt", models / "tiny-stt"), device)
    placed, dtypes = on_device(dev, device)
    t = np.arange(3 * cpu.sample_rate) / cpu.sample_rate
    x = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    want = cpu.transcribe(x, TranscriptionRequest(language="en"), StepContext())
    got, seconds = timed(lambda: dev.transcribe(x, TranscriptionRequest(language="en"), StepContext()))
    # a 65 s file: its three 30 s windows in one shared decode on the device (workers.stt, Shared decodes)
    long = np.tile(x, 22)[: 65 * cpu.sample_rate]
    before = dev.decodes
    windows, long_seconds = timed(lambda: dev.transcribe(long, TranscriptionRequest(language="en"), StepContext()))
    decodes = (dev.decodes - before) / 2  # timed() runs it twice
    # streamed with logprobs: each piece's tokens read from the device's scores as they are chosen, joined
    # to the transcript's own (fp16 scores on CUDA: the same tensor either way)
    asked = TranscriptionRequest(language="en", logprobs=True)
    pieces: list = []
    streamed = dev.transcribe(x, asked, StepContext(), pieces.append)
    joined = [e for p in pieces for e in p.logprobs]
    logprobs_match = [e.token for e in joined] == [e.token for e in streamed.logprobs] and all(
        abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(joined, streamed.logprobs))
    return {"placed": placed, "dtypes": dtypes, "text_equal": got.text == want.text, "language": got.language,
            "seconds": seconds, "long_decodes": decodes, "long_seconds": long_seconds,
            "streamed_logprobs": [len(joined), len(streamed.logprobs)], "streamed_logprobs_match": logprobs_match,
            "ok": placed and isinstance(got.text, str) and got.duration > 2.9 and decodes == 1 and windows.duration > 64.9
            and logprobs_match}


def check_embed(models: Path, device: torch.device) -> dict:
    from workers.embed import EmbedWorker

    cpu, dev = pair(EmbedWorker, ModelSpec("tiny-embed", "embed", models / "tiny-embed"), device)
    placed, dtypes = on_device(dev, device)
    ids = cpu.tokenize(["a b", "one two three four", "hi", "the dog " * 30])
    want = cpu.embed(ids, None, StepContext())
    got, seconds = timed(lambda: dev.embed(ids, None, StepContext()))
    cos = (want * got).sum(1) / (np.linalg.norm(want, axis=1) * np.linalg.norm(got, axis=1))
    return {"placed": placed, "dtypes": dtypes, "min_cosine": float(cos.min()), "seconds": seconds,
            "ok": placed and got.shape == want.shape and float(cos.min()) >= 0.999}


def check_moderation(models: Path, device: torch.device) -> dict:
    from workers.moderation import ModerationWorker

    cpu, dev = pair(ModerationWorker, ModelSpec("tiny-moderation", "moderation", models / "tiny-moderation"), device)
    placed, dtypes = on_device(dev, device)
    texts = cpu.tokenize(["a calm sentence", "another one, longer than the first " * 10])
    want = cpu.classify(texts, StepContext())
    got, seconds = timed(lambda: dev.classify(texts, StepContext()))
    diff = float(np.abs(got - want).max())
    return {"placed": placed, "dtypes": dtypes, "max_abs_diff": diff, "seconds": seconds,
            "ok": placed and got.shape == want.shape and diff <= 1e-3}


def check_rerank(models: Path, device: torch.device) -> dict:
    from workers.rerank import RerankWorker

    cpu, dev = pair(RerankWorker, ModelSpec("tiny-rerank", "rerank", models / "tiny-rerank"), device)
    placed, dtypes = on_device(dev, device)
    pieces = cpu.tokenize("which tier comes first?", ["paid comes first", "a fox", "batch waits for idle time " * 30])
    want = cpu.score(pieces, StepContext())
    got, seconds = timed(lambda: dev.score(pieces, StepContext()))
    diff = float(np.abs(got - want).max())
    return {"placed": placed, "dtypes": dtypes, "max_abs_diff": diff, "seconds": seconds,
            "ok": placed and got.shape == want.shape and diff <= 1e-3}


CHECKS = {"chat": check_chat, "vision": check_vision, "image": check_image, "tts": check_tts, "stt": check_stt, "embed": check_embed,
          "moderation": check_moderation, "rerank": check_rerank, "train": check_train}


def main() -> int:
    p = argparse.ArgumentParser(description="the workers on a CUDA device against CPU")
    p.add_argument("--models", type=Path, default=ROOT / "demo-models")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results")
    p.add_argument("--kinds", nargs="+", default=list(CHECKS), choices=list(CHECKS))
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    results, ok = {}, True
    for kind in args.kinds:
        start = time.perf_counter()
        try:
            res = CHECKS[kind](args.models, device)
        except Exception as e:  # one modality's failure must not hide the others' results
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        res["wall_s"] = round(time.perf_counter() - start, 2)
        results[kind] = res
        ok &= bool(res["ok"])
        shown = {k: v for k, v in res.items() if k != "trace"}
        print(f"{kind:<11} {'ok' if res['ok'] else 'FAIL':<5} {json.dumps(shown, default=str)}", flush=True)
        if "trace" in res:
            print(res["trace"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "workers.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"verdict: {'PASS' if ok else 'FAIL'} (every worker on {device.type}, results within the stated bounds)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
