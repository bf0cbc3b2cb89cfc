#!/usr/bin/env python3
"""Put documents in a vector store on tiergate, search them, and answer from them, with the
official openai SDK.

    python scripts/file_search_demo.py --base-url http://127.0.0.1:8000/v1 --api-key $KEY \
        --question "How are models evicted?" README.md docs/*.md

Uploads each file (text, Markdown or PDF), makes one vector store of them and waits while the
server reads them, prints the best chunks for the question, then asks the chat model with the
file_search tool and prints its answer with the files it cites. The store is deleted at the end
unless --keep. (On the demo models the embeddings are random weights: the hits show the mechanics,
not relevance.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import openai


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="documents to put in the store")
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--model", default="tiny-chat", help="the chat model that answers")
    p.add_argument("--question", default="What does this project do?")
    p.add_argument("--results", type=int, default=3, help="chunks to show and to give the model")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--keep", action="store_true", help="keep the vector store (its id is printed)")
    args = p.parse_args(argv)
    if not args.api_key:
        p.error("give --api-key or set OPENAI_API_KEY")
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)

    store = client.vector_stores.create(name="file_search_demo")
    print(f"vector store {store.id} (embedding model {store.model_extra.get('model')})")
    try:
        start = time.monotonic()
        batch = client.vector_stores.file_batches.upload_and_poll(
            store.id, files=[(path.name, path.read_bytes()) for path in args.files], poll_interval_ms=200)
        counts = batch.file_counts
        print(f"read {counts.completed} of {counts.total} files in {time.monotonic() - start:.1f} s"
              + (f", {counts.failed} failed" if counts.failed else ""))
        for f in client.vector_stores.files.list(store.id, filter="failed"):
            print(f"  failed: {f.id}: {f.last_error.code}: {f.last_error.message}")

        print(f"\nsearch: {args.question}")
        for hit in client.vector_stores.search(store.id, query=args.question, max_num_results=args.results):
            text = " ".join(hit.content[0].text.split())
            print(f"  {hit.score:.3f}  {hit.filename}: {text[:100]}{'...' if len(text) > 100 else ''}")

        answer = client.responses.create(
            model=args.model, input=args.question, max_output_tokens=args.max_tokens,
            tools=[{"type": "file_search", "vector_store_ids": [store.id], "max_num_results": args.results}],
            include=["file_search_call.results"])
        search = next(item for item in answer.output if item.type == "file_search_call")
        print(f"\n{args.model} read {len(search.results or [])} excerpts and answered:\n  {answer.output_text!r}")
        cited = [a.filename for item in answer.output if item.type == "message"
                 for part in item.content for a in part.annotations]
        print(f"  citing: {', '.join(cited) if cited else 'no file by name'}")
    finally:
        if args.keep:
            print(f"\nkept {store.id}")
        else:
            client.vector_stores.delete(store.id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
