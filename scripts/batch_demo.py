#!/usr/bin/env python3
"""Submit a chat batch to tiergate with the official openai SDK, watch it, print the results.

    python scripts/batch_demo.py --base-url http://127.0.0.1:8000/v1 --api-key $KEY -n 20

Every line runs at the batch tier, so on a busy server the bar waits while other tiers work.
Ctrl-C cancels the batch.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

import openai

ENDED = ("completed", "failed", "expired", "cancelled")
QUESTIONS = ["What is a GPU?", "Name a colour.", "Say hello.", "Count to three.", "What is batch work?"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--model", default="tiny-chat")
    p.add_argument("-n", type=int, default=20, help="requests in the batch")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    if not args.api_key:
        p.error("give --api-key or set OPENAI_API_KEY")
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)

    lines = [{"custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": args.model, "max_tokens": args.max_tokens,
                       "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}}
             for i in range(args.n)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("batch_demo.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"source": "batch_demo.py"})
    print(f"file {upload.id} ({upload.bytes} bytes) -> batch {batch.id}")

    started = time.monotonic()
    try:
        while batch.status not in ENDED:
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
            _bar(batch, time.monotonic() - started)
    except KeyboardInterrupt:
        print(f"\ncancelling {batch.id} ...")
        batch = client.batches.cancel(batch.id)
        while batch.status not in ENDED:
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
    _bar(batch, time.monotonic() - started)
    print()

    if batch.errors and batch.errors.data:
        for e in batch.errors.data:
            print(f"batch error {e.code}: {e.message}")
    if batch.output_file_id:
        for row in _jsonl(client.files.content(batch.output_file_id).text):
            answer = row["response"]["body"]["choices"][0]["message"]["content"]
            print(f"{row['custom_id']:>6}: {answer!r}")
    if batch.error_file_id:
        for row in _jsonl(client.files.content(batch.error_file_id).text):
            err = row["error"] or row["response"]["body"]["error"]
            print(f"{row['custom_id'] or '-':>6}: FAILED {err.get('code')}: {err.get('message')}")
    return 0 if batch.status == "completed" else 1


def _bar(batch, elapsed: float, width: int = 30) -> None:
    counts = batch.request_counts
    total = counts.total if counts else 0
    done = (counts.completed + counts.failed) if counts else 0
    filled = int(width * done / total) if total else 0
    failed = f", {counts.failed} failed" if counts and counts.failed else ""
    sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}{failed}  "
                     f"{batch.status:<11} {elapsed:5.1f}s")
    sys.stdout.flush()


def _jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main())
