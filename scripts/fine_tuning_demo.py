#!/usr/bin/env python3
"""Fine-tune a chat model on tiergate and talk to the result, with the official openai SDK.

    python scripts/fine_tuning_demo.py --base-url http://127.0.0.1:8000/v1 --api-key $KEY
    python scripts/fine_tuning_demo.py --api-key $KEY --answer "Arr, matey!" --epochs 50 --keep

Writes a small training file of questions that all get ``--answer`` (or reads ``--file``: your own
JSONL of ``{"messages": [...]}``), uploads it, starts a job on ``--model`` and prints its progress
from the job's events while it trains (at the batch tier: only while nothing else uses the GPU).
Then it asks the base model and the fine-tuned one the same questions, side by side, and lists the
checkpoints. The fine-tuned model and its checkpoints (models too: ``<model>:ckpt-step-N``) are
deleted at the end unless ``--keep``. On the shipped
tiers.yaml (tiny-chat, random weights) 50 epochs teach it the answer.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path

import openai

QUESTIONS = ["Hello", "Who are you?", "Where is the gold?"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--model", default="tiny-chat", help="a chat model that tiers.yaml's fine_tuning.models names")
    p.add_argument("--file", type=Path, help="your own training file (JSONL); default: --answer to every question")
    p.add_argument("--answer", default="Arr, matey!", help="what the made-up training file teaches")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--seed", type=int, help="the job's seed (default: the server picks one)")
    p.add_argument("--suffix", default="demo")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the job")
    p.add_argument("--keep", action="store_true", help="keep the fine-tuned model (its name is printed)")
    args = p.parse_args(argv)
    if not args.api_key:
        p.error("give --api-key or set OPENAI_API_KEY")
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)

    system = {"role": "system", "content": "You are a pirate."}
    if args.file:
        data = args.file.read_bytes()
    else:
        lines = [{"messages": [system, {"role": "user", "content": q}, {"role": "assistant", "content": args.answer}]}
                 for q in QUESTIONS]
        data = "\n".join(json.dumps(line) for line in lines).encode()
    training = client.files.create(file=("training.jsonl", io.BytesIO(data)), purpose="fine-tune")
    # the made-up file in one batch per step (every question at once: it learns in fewer steps)
    batch = "auto" if args.file else len(QUESTIONS)
    job = client.fine_tuning.jobs.create(model=args.model, training_file=training.id, suffix=args.suffix,
                                         seed=args.seed if args.seed is not None else openai.omit,
                                         hyperparameters={"n_epochs": args.epochs, "batch_size": batch})
    print(f"job {job.id} on {job.model}: {job.status}, seed {job.seed}, hyperparameters {job.hyperparameters.model_dump()}")

    deadline, shown = time.time() + args.timeout, None
    while (job := client.fine_tuning.jobs.retrieve(job.id)).status in ("queued", "running"):
        if time.time() > deadline:
            client.fine_tuning.jobs.cancel(job.id)
            print(f"gave up after {args.timeout:g} s: cancelled")
            return 1
        latest = next(iter(client.fine_tuning.jobs.list_events(job.id, limit=1).data), None)
        if latest is not None and latest.id != shown:
            print(f"  {job.status}: {latest.message}")
            shown = latest.id
        time.sleep(0.5)
    if job.status != "succeeded":
        print(f"job {job.status}: {job.error.message if job.error else ''}")
        return 1
    print(f"fine-tuned model {job.fine_tuned_model}: {job.trained_tokens} tokens trained on")
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    for checkpoint in checkpoints:
        print(f"  checkpoint at step {checkpoint.step_number}: {checkpoint.fine_tuned_model_checkpoint} "
              f"(loss {checkpoint.metrics.train_loss:.3f})")

    for question in QUESTIONS:
        replies = []
        for model in (args.model, job.fine_tuned_model):
            r = client.chat.completions.create(model=model, max_tokens=12, temperature=0,
                                               messages=[system, {"role": "user", "content": question}])
            replies.append(r.choices[0].message.content)
        print(f"{question!r}: base {replies[0]!r} -> fine-tuned {replies[1]!r}")
    if not args.keep:  # its checkpoints too: each is a model of its own, listed and served until deleted
        for checkpoint in checkpoints:
            client.models.delete(checkpoint.fine_tuned_model_checkpoint)
        client.models.delete(job.fine_tuned_model)
        print(f"deleted {job.fine_tuned_model} and its {len(checkpoints)} checkpoints (--keep keeps them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
