"""The indexer: the files added to vector stores read in the background, one process at a time
each, and never lost.

A file's text (``gateway.documents``: PDF, Word, PowerPoint, HTML or UTF-8 text) is cut into chunks of the
embedding model's tokens (``EmbedWorker.cut``), each group of chunks embedded as a request of the
key that added the file, at its tier, through the gate; then ``completed`` with its chunks, or
``failed`` with the reason, in ``gateway.vector_store``. A process takes a file with a lease it
renews as it goes; a file whose process died is taken again once its lease ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable
from typing import TypeVar

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from batch.store import Store as BatchStore
from gateway.auth import Caller
from gateway.claim_loop import ClaimLoop
from gateway.documents import Unreadable, document_text
from gateway.embeddings import EmbedJob, serve_embeddings
from gateway.errors import APIError
from gateway.service import Services
from gateway.vector_search import encoder_of
from gateway.vector_store import StoreFile, VectorStoreStore
from workers.embed import InputError

log = logging.getLogger("tiergate.vector_stores")
T = TypeVar("T")
LEASE_S = 60.0  # a file being read is another process's to take once its lease is this old
GROUP = 64  # chunks embedded in one request
MAX_FILE_TOKENS = 5_000_000  # tokens of text one file may have, as OpenAI's file search allows


class _Dropped(Exception):
    """The file was removed, added again or its store deleted while it was read: leave it."""


class Indexer(ClaimLoop[StoreFile], Collector):
    """Reads the files added to vector stores, one at a time, in the order added. One task owns
    the work: it claims a waiting file (its own, another process's, or one whose process died: its
    lease ended), reads it, and finishes or fails it; it sleeps until a file is added here
    (``wake``) or ``POLL_S`` passes. A file's chunks are embedded ``GROUP`` at a time, each group
    one request of the key that added the file, at its tier, waiting its turn at the gate as any
    request does (a 429 there is waited out, not a failure); the lease is renewed after each group.
    Stopped at shutdown: a file half read is given up (its lease ended now, where a crash leaves it
    to run out) and taken again, whole, by the next process to claim it.
    ``/metrics`` shows the files this process read by how they ended, the chunks it embedded and
    whether it is reading one now (``collect``)."""

    log = log
    work = "vector stores: claiming or recording a file"

    def __init__(self, svc: Services, store: VectorStoreStore, files: BatchStore) -> None:
        super().__init__()
        self.svc, self.store, self.files = svc, store, files
        self.ended: Counter[str] = Counter()  # completed, failed, dropped (removed or added again meanwhile)
        self.chunks = 0
        self.reading = False

    def collect(self):
        files = CounterMetricFamily("tiergate_vector_store_files_read", "Files this process read into vector stores, "
                                    "by outcome (completed, failed, dropped: removed or added again meanwhile)",
                                    labels=["outcome"])
        for outcome in ("completed", "failed", "dropped"):
            files.add_metric([outcome], self.ended[outcome])
        yield files
        yield CounterMetricFamily("tiergate_vector_store_chunks", "Chunks this process embedded into vector stores",
                                  value=self.chunks)
        yield GaugeMetricFamily("tiergate_vector_store_reading", "1 while this process reads a file into a vector store",
                                value=int(self.reading))

    async def _claim(self) -> StoreFile | None:
        # one at a time: a second file claimed now would wait under a lease nobody renews
        taken = await self.store.claim(time.time(), LEASE_S, 1)
        return taken[0] if taken else None

    async def _work(self, file: StoreFile) -> None:
        await self._index(file)

    async def _index(self, file: StoreFile) -> None:
        self.reading = True
        try:
            texts, vectors = await self._read(file)
            ended = "completed" if await self.store.finish(file, texts, vectors) else "dropped"
            self.chunks += len(texts) if ended == "completed" else 0
        except Unreadable as refused:
            ended = "failed" if await self.store.fail(file, refused.code, refused.message) else "dropped"
        except _Dropped:
            ended = "dropped"
        except asyncio.CancelledError:  # stopped (a shutdown): the next process to look takes the file at once
            with contextlib.suppress(Exception):  # (a store that does not answer: its lease ends, as for a crash)
                await self.store.hold(file, time.time())
            raise
        except Exception as exc:  # noqa: BLE001 - recorded on the file; the indexer goes on
            log.exception("vector stores: reading %s into %s failed", file.id, file.vector_store_id)
            message = exc.message if isinstance(exc, APIError) else "the server failed while reading the file"
            ended = "failed" if await self.store.fail(file, "server_error", message) else "dropped"
        finally:
            self.reading = False
        self.ended[ended] += 1

    async def _read(self, file: StoreFile) -> tuple[list[str], np.ndarray]:
        """The file's chunks and their vectors; ``Unreadable`` for a file that is not text."""
        store = await self.store.get(file.vector_store_id, file.owner)
        if store is None:
            raise _Dropped
        content = await self.files.file_content(file.id)
        if content is None:
            raise Unreadable("invalid_file", "the file was deleted before it was read")
        text = await self._held_while(file, asyncio.to_thread(document_text, content, file.filename))
        encoder = await encoder_of(self.svc, store.model)
        chunks = encoder.cut(text, file.chunk_tokens, file.overlap_tokens, MAX_FILE_TOKENS)
        caller = Caller(file.tier, file.owner)
        texts: list[str] = []
        parts = []
        while True:  # a group cut (off the loop), then embedded: the file's tokens are never all in memory
            try:
                group = await asyncio.to_thread(lambda: list(itertools.islice(chunks, GROUP)))
            except InputError:
                raise Unreadable("invalid_file", f"the file has more than {MAX_FILE_TOKENS:,} tokens of text, "
                                               "the most one file may have") from None
            if not group:
                break
            texts += [t for t, _ in group]
            parts.append(await self._embed(file, caller, store.model, [row for _, row in group]))
            if not await self.store.hold(file, time.time() + LEASE_S):
                raise _Dropped
        if not texts:
            raise Unreadable("invalid_file", "the file has no text")
        return texts, np.concatenate(parts)

    async def _held_while(self, file: StoreFile, work: Awaitable[T]) -> T:
        """``work`` (a document's parse in a thread: a large PDF's may take minutes), with the
        file's lease renewed every third of ``LEASE_S`` meanwhile, so that no other process takes
        the file and reads it again while it runs (``_Dropped`` when it was taken from this one)."""
        task = asyncio.ensure_future(work)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (its error read where no one waits)
        try:
            while not (await asyncio.wait({task}, timeout=LEASE_S / 3))[0]:
                if not await self.store.hold(file, time.time() + LEASE_S):
                    raise _Dropped
            return task.result()
        finally:
            task.cancel()  # (a thread runs on to its end; its result is not waited for)

    async def _embed(self, file: StoreFile, caller: Caller, model: str, rows: list[list[int]]) -> np.ndarray:
        while True:
            try:
                return await serve_embeddings(self.svc, caller, EmbedJob(model, rows, None), None)
            except APIError as exc:
                if exc.status != 429:
                    raise
                wait = exc.headers.get("retry-after", "1")
                await asyncio.sleep(min(30.0, max(0.5, float(wait) if wait.isdigit() else 1.0)))
                if not await self.store.hold(file, time.time() + LEASE_S):
                    raise _Dropped from None


def indexer_for(svc: Services, store: VectorStoreStore, files: BatchStore) -> Indexer:
    """The process's indexer, started once the stores are open and stopped before they close."""
    indexer = Indexer(svc, store, files)
    svc.on_startup.append(indexer.start)
    svc.on_shutdown.append(indexer.stop)
    svc.metrics.registry.register(indexer)
    return indexer
