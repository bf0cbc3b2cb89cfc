"""LoRA adapters a request can ask for: read from tiers.yaml ``adapters:`` at start-up, and resolved
per request into the base model plus an adapter stack.

A request selects adapters in two ways (as vLLM does for the first):

* ``model: "<adapter>"``: that adapter at weight 1.0 on its base model;
* ``model: "<base>"`` plus ``adapters: [{"name": ..., "weight": ...}, ...]``: a weighted stack
  (after the model's own adapter, if ``model`` names one).

Adapter names map to folders only through the config, so no request reaches a path of its choosing.
An adapter is read, checked against its format's rules (DoRA and other variants are refused) and
against the base model's checkpoint (every targeted module exists with a fitting shape) before the
server starts; any problem is a one-line :class:`ConfigError` naming the adapter.

``adapter_dirs:`` add adapters without a restart (an army of them, more than host memory holds):
each subfolder of such a folder, named as an adapter may be, is an adapter of the folder's base
model. It is read and checked the first time a request names it (off the event loop:
:meth:`AdapterRegistry.ready`), kept in host memory while the ``gpu.adapter_cache_budget`` has
room (least recently used dropped first), and read again when its files change (a per-request
listing of its folder: size, mtime and inode of each file). A folder that is gone is an adapter that is
gone. Names resolve in this order: models and aliases, configured adapters, adapters loaded at
run time (vLLM's ``POST /v1/load_lora_adapter``, admin keys, this process only), then the folders
in the order listed. A subfolder that is not a LoRA that fits its model is a 400 ``adapter_invalid``
for the requests that name it, and is read again only once its files change. Files still being
written (a copy under way) are not taken for a broken adapter, nor served half read: a read during
which the files changed, or that failed on files younger than ``SETTLE_S``, is a 503
``adapter_changing`` with ``Retry-After``, and the next request reads the folder again.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import os
import re
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import Field
from safetensors import SafetensorError, safe_open
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.config import ADAPTER_NAME, AdapterConfig, Config, ConfigError, a_kind
from gateway.errors import APIError, bad_request, not_found
from gateway.schemas import MAX_STACK, AdapterChoice, _Body, parse, read_json
from lora_kernels import AdapterFormatError, LoraAdapter, load_diffusers_lora, load_peft_adapter
from lora_kernels.adapters import DIFFUSERS_WEIGHTS, PEFT_CONFIG
from lora_kernels.stack import resolve_module
from workers.base import AdapterStackSpec, ModelSpec

if TYPE_CHECKING:
    from gateway.accounts import Accounts
    from gateway.auth import Caller
    from gateway.service import Services

DENOISERS = ("unet", "transformer")  # the pipeline component a diffusers LoRA may target


log = logging.getLogger("tiergate.adapters")
NAME = ADAPTER_NAME
Signature = tuple[tuple[str, int, int, int], ...]  # a folder's files: (name, size, mtime_ns, inode)
SETTLE_S = 2.0  # a read that fails on files younger than this may have met a copy under way
# the key whose allow-lists this task (one request, or one batch line) resolves adapters for
_viewer: contextvars.ContextVar[tuple[Accounts, Caller] | None] = \
    contextvars.ContextVar("tiergate_adapters_viewer", default=None)
# the folder adapters ``ready`` found or read for this task (one request), by name: ``get`` serves them
# even when the budget has dropped them since (a stack larger than it, or another request's reads),
# rather than read them again itself, on the event loop
_readied: contextvars.ContextVar[dict[str, ServedAdapter] | None] = \
    contextvars.ContextVar("tiergate_adapters_readied", default=None)


def resolve_as(accounts: Accounts | None, caller: Caller) -> None:
    """Resolve adapters in this task as ``caller``'s key sees them: one outside its allow-lists
    (docs/ACCOUNTS.md) is an adapter that does not exist, on every endpoint and before anything
    else is said about it (its kind, its base model, its files), so no answer tells a key which
    adapters other keys have."""
    _viewer.set(None if accounts is None else (accounts, caller))


def may_use(model: str) -> bool:
    """Whether this task's key may use the model ``model`` (its models allow-list; ``resolve_as``):
    one it may not is, to it, a model that does not exist."""
    viewer = _viewer.get()
    return viewer is None or viewer[0].allows(viewer[1], model)


def _hidden(name: str, model: str) -> bool:
    """Whether the adapter ``name`` of the model ``model`` is outside this task's key's allow-lists."""
    viewer = _viewer.get()
    if viewer is None:
        return False
    accounts, caller = viewer
    return not (accounts.allows(caller, model) and accounts.allows_adapter(caller, name))


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter, loaded (factors in host memory): configured in tiers.yaml, or read from an
    ``adapter_dirs`` folder."""

    name: str
    model: str  # the base model
    kind: str  # the base model's kind: chat or image
    format: str  # peft or diffusers
    path: Path
    adapter: LoraAdapter  # its ``name`` is the served name, or ``name@N`` for the N-th content read under it
    source: str = "config"  # or "folder", or "runtime" (POST /v1/load_lora_adapter)
    signature: Signature = ()  # a folder adapter's files when read
    created: int = 0  # its folder's (or file's) modification time when read (``made_at``)

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.adapter.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.adapter.modules.values() for t in (m.up, m.down))

    def row(self) -> dict[str, Any]:
        """Its /v1/models entry."""
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": owned_by(self.name),
                "kind": "adapter", "parent": self.model, "root": self.model, "base_kind": self.kind,
                "format": self.format, "rank": self.rank, "modules": len(self.adapter.modules), "source": self.source}


@dataclass(frozen=True)
class AdapterDir:
    """An ``adapter_dirs`` folder: its base model's name, kind and checkpoint folder. Its adapters
    are its subfolders, and for an image model also its ``<name>.safetensors`` files (a diffusers
    LoRA is often one file); a subfolder comes before a file of the same name."""

    model: str
    kind: str
    path: Path
    model_path: Path
    format: str | None = None
    max_rank: int | None = None  # the largest rank its model's engine serves (vLLM's max_lora_rank); None: any

    def locate(self, name: str) -> tuple[Path, Signature] | None:
        """Where the adapter ``name`` is in this folder, with its files' signature; None if nowhere."""
        folder = self.path / name
        files = signature(folder)
        if files is not None:
            return folder, files
        if self.kind == "image":
            file = self.path / f"{name}{LORA_FILE}"
            try:
                return file, _file_signature(file)
            except (FileNotFoundError, NotADirectoryError):
                return None
            except OSError as exc:
                log.warning("adapter_dirs: cannot read %s: %s", file, exc)
        return None

    def entries(self) -> list[str]:
        """The names of the adapters in this folder, sorted, those starting with a dot left out (a
        copy being staged). Raises OSError when the folder cannot be listed."""
        names = set()
        with os.scandir(self.path) as found:
            for e in found:
                if e.name.startswith("."):
                    continue
                if e.is_dir():
                    names.add(e.name)
                elif self.kind == "image" and e.name.endswith(LORA_FILE) and e.is_file():
                    names.add(e.name.removesuffix(LORA_FILE))
        return sorted(names)


LORA_FILE = ".safetensors"  # an image model's adapter as one file in its folder


def signature(folder: Path) -> Signature | None:
    """The files of ``folder`` as (name, size, mtime_ns, inode): a file written again or replaced
    changes it. None when it is not a folder."""
    try:
        with os.scandir(folder) as entries:
            return tuple(sorted((e.name, (st := e.stat()).st_size, st.st_mtime_ns, st.st_ino) for e in entries if e.is_file()))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # unreadable (permissions): as if absent, and the operator is told
        log.warning("adapter_dirs: cannot read %s: %s", folder, exc)
        return None


def _file_signature(file: Path) -> Signature:
    """One file's (name, size, mtime_ns, inode): a diffusers LoRA given as its file."""
    st = file.stat()
    return ((file.name, st.st_size, st.st_mtime_ns, st.st_ino),)


def made_at(path: Path) -> int:
    """(thread) An adapter's ``created`` in /v1/models: its folder's (or file's) modification time,
    in whole seconds (a fine-tuned model's or checkpoint's: when its job published it); 0 when it
    cannot be read."""
    try:
        return int(path.stat().st_mtime)
    except OSError:
        return 0


_CHECKPOINT_END = re.compile(r":ckpt-step-[0-9]+$")


def owned_by(name: str) -> str:
    """An adapter's ``owned_by`` in /v1/models. A fine-tuned model's (and its checkpoints'): the key
    that made it, as its name ``ft:<model>:<key id>:<suffix>:<job>`` says (OpenAI's names carry the
    organisation there; the key's id, never the key), read from the right end as a model's name may
    hold ':'. Any other: this server, as for base models."""
    fields = _CHECKPOINT_END.sub("", name).rsplit(":", 3)
    fine_tuned = name.startswith("ft:") and len(fields) == 4 and fields[0] != "ft" and fields[1]
    return fields[1] if fine_tuned else "tiergate"


def _files_now(path: Path) -> Signature | None:
    """The signature of an adapter's folder or file as it is now (None: gone)."""
    found = signature(path)
    if found is None:
        try:
            return _file_signature(path)
        except OSError:
            return None
    return found


class AdapterRegistry:
    """The adapters requests may select: the configured ones (always held) and those read from the
    ``adapter_dirs`` folders (held while ``cache_bytes`` has room)."""

    def __init__(self, adapters: Iterable[ServedAdapter] = (), dirs: Sequence[AdapterDir] = (),
                 models: Iterable[str] = (), cache_bytes: int = 2 << 30) -> None:
        self.adapters = {a.name: a for a in adapters}
        self.loaded: dict[str, ServedAdapter] = {}  # by POST /v1/load_lora_adapter: held until unloaded
        self.dirs = tuple(dirs)
        self.models = frozenset(models)  # never looked for on disk
        self.cache_bytes = cache_bytes
        self.cached: OrderedDict[str, ServedAdapter] = OrderedDict()  # folder adapters, least recently used first
        self._refused: dict[tuple[Path, Signature], str] = {}  # a folder's files -> why they are no adapter
        self._reads: dict[tuple[Path, Signature], asyncio.Task] = {}  # folder reads under way (``ready``)
        self._seen: dict[str, tuple[Signature, int]] = {}  # a name's latest files and how many contents it had
        self._shapes: dict[Path, dict[str, tuple[int, ...]]] = {}  # a base checkpoint's weight shapes
        self.reads: Counter[str] = Counter()  # folder reads by outcome (read, refused, changing), counted on the loop
        self.dropped = 0  # folder adapters dropped from host memory past the budget

    def get(self, name: str) -> ServedAdapter | None:
        """The adapter ``name`` names: configured, or a folder's (read here, on the calling thread,
        if ``ready`` has not read it); None when there is none, or when this task's key may not
        use it (``resolve_as``). 400 ``adapter_invalid`` for a folder that is no LoRA fitting its model."""
        served = self.adapters.get(name) or self.loaded.get(name)
        if served is not None or not self.dirs or name in self.models or not NAME.fullmatch(name):
            return None if served is not None and _hidden(name, served.model) else served
        found = self._find(name)
        if found is None:  # removed from its folder: not held any more either
            self.cached.pop(name, None)
            return None
        d, folder, files = found
        if _hidden(name, d.model):  # not read either: its files' state would tell that it exists
            return None
        held = self.cached.get(name)
        if held is not None and held.path == folder and held.signature == files:
            self.cached.move_to_end(name)
            return held
        readied = (_readied.get() or {}).get(name)
        if readied is not None and readied.path == folder and readied.signature == files:
            return readied  # read for this request by ``ready``, dropped past the budget since
        self._check_refused(name, folder, files)
        try:
            served = self._read(name, d, folder, files, self._version(name, files))
        except _NotAnAdapter as exc:
            if _young(files):  # a copy may still be writing them: not remembered as broken
                raise self._changing(name) from None
            self._refuse(folder, files, str(exc))
            self._check_refused(name, folder, files)
        except _Changing:
            raise self._changing(name) from None
        return self._keep(served)

    def base_of(self, name: str) -> tuple[str, str] | None:
        """The base model and its kind of the adapter ``name``, found without reading it (a folder's
        is listed, as ``get`` lists it: the event loop may ask); None when there is none, or when
        this task's key may not use it (``resolve_as``)."""
        served = self.adapters.get(name) or self.loaded.get(name)
        if served is not None:
            found = served.model, served.kind
        elif self.dirs and name not in self.models and NAME.fullmatch(name):
            located = self._find(name)
            found = None if located is None else (located[0].model, located[0].kind)
        else:
            return None
        return None if found is None or _hidden(name, found[0]) else found

    async def ready(self, model: str, choices: Sequence[AdapterChoice] | None) -> None:
        """Read, in a worker thread, the folder adapters among ``model`` and ``choices`` not held
        yet (once for every request that waits for the same files), so that ``get`` finds them
        without reading on the event loop."""
        if not self.dirs:
            return
        readied: dict[str, ServedAdapter] = {}  # only this call's: a task that readies many (a batch's
        _readied.set(readied)  # validation, name by name) keeps the last call's alone, never more than one stack
        for name in (model, *(c.name for c in choices or ())):
            if name in self.adapters or name in self.loaded or name in self.models or not NAME.fullmatch(name):
                continue
            found = self._find(name)
            if found is None:
                self.cached.pop(name, None)
                continue
            d, folder, files = found
            if _hidden(name, d.model):  # ``get`` answers it as missing, without reading it
                continue
            held = self.cached.get(name)
            if held is not None and held.path == folder and held.signature == files:
                readied[name] = held
                continue
            if (folder, files) in self._refused:
                continue
            key = (folder, files)
            read = self._reads.get(key)
            if read is None:
                read = self._reads[key] = asyncio.create_task(self._read_off_loop(name, d, folder, files))
                read.add_done_callback(lambda t: t.cancelled() or t.exception())  # those who waited may be gone
            served = await asyncio.shield(read)
            if served is not None:
                readied[name] = served

    async def _read_off_loop(self, name: str, d: AdapterDir, folder: Path, files: Signature) -> ServedAdapter | None:
        """The folder's adapter, read in a worker thread and held; None when it is no adapter (refused)."""
        try:
            served = await asyncio.to_thread(self._read, name, d, folder, files, self._version(name, files))
            return self._keep(served)
        except _NotAnAdapter as exc:
            if _young(files):  # a copy may still be writing them: not remembered as broken
                raise self._changing(name) from None
            self._refuse(folder, files, str(exc))
            return None
        except _Changing:
            raise self._changing(name) from None
        finally:
            del self._reads[(folder, files)]

    def _find(self, name: str) -> tuple[AdapterDir, Path, Signature] | None:
        for d in self.dirs:
            found = d.locate(name)
            if found is not None:
                return d, *found
        return None

    def _refuse(self, folder: Path, files: Signature, why: str) -> None:
        self._refused[(folder, files)] = why
        self.reads["refused"] += 1

    def _changing(self, name: str) -> APIError:
        """The 503 for a read that met files being written; the next request reads them again."""
        self.reads["changing"] += 1
        return APIError(503, f"the adapter '{name}' is being written (its files changed while they were read, or "
                        f"are under {SETTLE_S:g} s old and not yet an adapter); try again shortly", "adapter_changing",
                        "model", headers={"retry-after": "1"})

    def _check_refused(self, name: str, folder: Path, files: Signature) -> None:
        why = self._refused.get((folder, files))
        if why is not None:
            raise APIError(400, f"the adapter '{name}' cannot be served: {why}", "adapter_invalid", "model")

    def _version(self, name: str, files: Signature) -> str:
        """The name the adapter's content is known by inside the engines (stacks are keyed by it):
        ``name``, then ``name@2``, ``name@3``... each time its files change."""
        seen = self._seen.get(name)
        n = 1 if seen is None else seen[1] if seen[0] == files else seen[1] + 1
        self._seen[name] = (files, n)
        return name if n == 1 else f"{name}@{n}"

    def _read(self, name: str, d: AdapterDir, folder: Path, files: Signature, version: str) -> ServedAdapter:
        """(any thread) The folder's adapter, read and checked against its base model; ``_Changing``
        when its files changed while they were read."""
        try:
            shapes = self._shapes.get(d.model_path)
            if shapes is None:
                shapes = self._shapes[d.model_path] = checkpoint_shapes(d.model_path, d.kind)
            served = read_adapter(AdapterConfig(name=name, model=d.model, path=folder, format=d.format), d.kind,
                                  shapes, version)
        except Exception as exc:  # noqa: BLE001 - reading files: whatever fails (safetensors' own error too) is the folder's
            if _files_now(folder) != files:
                raise _Changing from None
            why = " ".join(str(exc).strip("'\"").split())
            log.warning("adapter '%s' at %s cannot be served: %s", name, folder, why)
            # the client is told why, not where: the server's paths stay the operator's
            raise _NotAnAdapter(why.replace(str(folder), name).replace(str(d.path), "the folder")) from None
        if _files_now(folder) != files:  # written to meanwhile: what was read may be half of it
            raise _Changing
        return ServedAdapter(name, d.model, d.kind, served.format, folder, served.adapter, "folder", files,
                             made_at(folder))

    def _keep(self, served: ServedAdapter) -> ServedAdapter:
        """Hold ``served`` (the most recently used), dropping the least recently used folder
        adapters beyond the budget (never the one just read: a request is waiting for it)."""
        self.cached[served.name] = served
        self.cached.move_to_end(served.name)
        self.reads["read"] += 1
        total = sum(a.nbytes for a in self.cached.values())
        while total > self.cache_bytes and len(self.cached) > 1:
            _, dropped = self.cached.popitem(last=False)
            total -= dropped.nbytes
            self.dropped += 1
        return served

    async def drop_gone(self) -> None:
        """Let go of the held folder adapters whose files are gone (their folder deleted or moved
        away), which no request would ask for again to find so: host memory and the ``held``
        gauges keep only adapters that exist. Their folders are looked at in a worker thread."""
        held = list(self.cached.values())
        if not held:
            return
        gone = await asyncio.to_thread(lambda: [a for a in held if _files_now(a.path) is None])
        for served in gone:
            if self.cached.get(served.name) is served:  # (not read again meanwhile)
                del self.cached[served.name]

    def collect(self):
        """Prometheus: the folder adapters read, refused, held and dropped by this process."""
        reads = CounterMetricFamily("tiergate_adapter_folder_reads", "adapter_dirs adapters read by this process, by "
                                    "outcome (read; refused: not a LoRA fitting its model; changing: its files "
                                    "changed while read, or a read failed on files still being written)",
                                    labels=["outcome"])
        for outcome in ("read", "refused", "changing"):
            reads.add_metric([outcome], self.reads[outcome])
        yield reads
        yield CounterMetricFamily("tiergate_adapter_folder_dropped", "adapter_dirs adapters dropped from host memory "
                                  "past gpu.adapter_cache_budget (read again when asked for)", value=self.dropped)
        held = list(self.cached.values())
        yield GaugeMetricFamily("tiergate_adapter_folder_held", "adapter_dirs adapters held in host memory", value=len(held))
        yield GaugeMetricFamily("tiergate_adapter_folder_held_bytes", "Host memory the held adapter_dirs adapters take "
                                "(their LoRA factors)", value=sum(a.nbytes for a in held))

    async def load(self, name: str, path: Path, base: AdapterDir, in_place: bool) -> ServedAdapter:
        """``POST /v1/load_lora_adapter``: the adapter at ``path`` served as ``name`` on ``base``'s
        model from now until it is unloaded (this process only; a restart forgets it), read and
        checked in a worker thread. 400 for a name a model, a configured or folder adapter has,
        or one loaded already (unless ``in_place``: read again, replacing it), and for files that
        are not a LoRA fitting the model."""
        if not NAME.fullmatch(name):
            raise bad_request(f"'{name[:80]}' cannot be an adapter's name: a name is {NAME.pattern}", "lora_name")
        if name in self.models:
            raise bad_request(f"the lora adapter '{name}' conflicts with a served base model", "lora_name")
        if name in self.adapters or (name not in self.loaded and self._find(name) is not None):
            raise bad_request(f"the lora adapter '{name}' is already served (tiers.yaml adapters or adapter_dirs)",
                              "lora_name")
        if name in self.loaded and not in_place:
            raise _loaded_already(name)
        files = signature(path) if path.is_dir() else _file_signature(path)
        try:
            served = await asyncio.to_thread(self._read, name, base, path, files, self._version(name, files))
        except _NotAnAdapter as exc:
            raise bad_request(f"the lora adapter '{name}' cannot be served: {exc}", "lora_path", "adapter_invalid") from None
        except _Changing:
            raise APIError(503, f"the files of the lora adapter '{name}' changed while they were read; try again shortly",
                           "adapter_changing", "lora_path", headers={"retry-after": "1"}) from None
        if name in self.loaded and not in_place:  # another call loaded it while this one read: the first one wins
            raise _loaded_already(name)
        self.loaded[name] = served = replace(served, source="runtime")
        return served

    def unload(self, name: str) -> None:
        """``POST /v1/unload_lora_adapter``: 404 for a name not loaded at run time (a configured or
        folder adapter is changed in tiers.yaml or its folder instead: 400)."""
        if self.loaded.pop(name, None) is not None:
            return
        if name in self.adapters or self._find(name) is not None:
            raise bad_request(f"the lora adapter '{name}' was not loaded at run time: it is served from tiers.yaml "
                              "or adapter_dirs", "lora_name")
        raise not_found(f"the lora adapter '{name}' cannot be found", "lora_name", "adapter_not_found")

    def survey(self) -> list[tuple[AdapterDir, str, str]]:
        """Every subfolder of every folder, read and checked now (``tiergate check``), without
        holding any: (folder, name, problem), the problem empty for an adapter that serves.
        Subfolders whose names start with a dot (a copy being staged) are left out."""
        found: list[tuple[AdapterDir, str, str]] = []
        taken = set(self.adapters) | self.models
        for d in self.dirs:
            try:
                names = d.entries()
            except OSError as exc:
                found.append((d, "", f"the folder cannot be listed: {exc}"))
                continue
            for name in names:
                if not NAME.fullmatch(name):
                    problem = f"no request can name it: a name is {NAME.pattern}"
                elif name in taken:
                    problem = "not served: a model, a configured adapter or an earlier folder has this name"
                else:
                    taken.add(name)
                    where = d.locate(name)
                    try:
                        if where is None:
                            raise _NotAnAdapter("gone while it was read")
                        problem = _beyond_engine(self._read(name, d, where[0], where[1], name), d)
                    except _NotAnAdapter as exc:
                        problem = f"refused: {exc}"
                    except _Changing:
                        problem = "its files changed while they were read (a copy under way?): check again"
                found.append((d, name, problem))
        return found

    def rows(self) -> list[dict[str, Any]]:
        """The configured adapters' /v1/models entries, then every folder adapter's (one listing of
        each folder: call it off the event loop when folders are configured)."""
        rows = [a.row() for a in (*self.adapters.values(), *self.loaded.values())]
        shown = set(self.adapters) | set(self.loaded) | self.models
        for d in self.dirs:
            try:
                names = [name for name in d.entries() if NAME.fullmatch(name)]
            except OSError:
                continue
            for name in names:
                if name in shown:
                    continue
                shown.add(name)
                held = self.cached.get(name)
                rows.append(held.row() if held is not None and held.path.parent == d.path else
                            {"id": name, "object": "model",
                             "created": made_at(d.path / name) or made_at(d.path / f"{name}{LORA_FILE}"),
                             "owned_by": owned_by(name), "kind": "adapter", "parent": d.model, "root": d.model,
                             "base_kind": d.kind, "format": d.format, "rank": None, "modules": None,
                             "source": "folder"})
        return rows

    def base_model(self, model: str) -> str:
        """The model a request runs on: the adapter's base when ``model`` names an adapter."""
        served = self.get(model)
        return served.model if served is not None else model

    def stack(self, model: str, choices: Sequence[AdapterChoice] | None, kind: str) -> AdapterStackSpec:
        """The adapter stack of a request for ``model`` (a base model or an adapter) plus ``choices``:
        404 for an unknown adapter, 400 for one of another base model or kind, or a repeated one."""
        return self.stack_on(self.get(model), model, choices, kind)

    def stack_on(self, own: ServedAdapter | None, model: str, choices: Sequence[AdapterChoice] | None,
                 kind: str) -> AdapterStackSpec:
        """``stack`` with ``own`` = ``get(model)`` already looked up."""
        base = own.model if own is not None else model
        stack: list[tuple[LoraAdapter, float]] = []
        if own is not None:
            if own.kind != kind:
                raise bad_request(f"'{model}' is an adapter of the {own.kind} model '{base}', not of a {kind} model",
                                  "model", "model_not_supported")
            stack.append((own.adapter, 1.0))
        for choice in choices or ():
            served = self.get(choice.name)
            if served is None:
                raise not_found(f"the adapter '{choice.name}' does not exist", "adapters", "adapter_not_found")
            if served.model != base:
                raise bad_request(f"the adapter '{choice.name}' is for the model '{served.model}', not '{base}'",
                                  "adapters", "adapter_model_mismatch")
            stack.append((served.adapter, choice.weight))
        names = list(served_names(tuple(stack)))
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise bad_request(f"the adapter '{repeated[0]}' is selected more than once", "adapters")
        if len(stack) > MAX_STACK:
            raise bad_request(f"{len(stack)} adapters in one stack, above this server's limit of {MAX_STACK}",
                              "adapters")
        return tuple(stack)


def _beyond_engine(served: ServedAdapter, d: AdapterDir) -> str:
    """What the engine of ``d``'s model refuses in an adapter that reads as one (``tiergate check``:
    a request for it would be a 400): on vLLM, a rank above ``max_lora_rank``, every module's
    counted (a ``rank_pattern``'s too); empty when it serves."""
    if d.max_rank is not None and served.rank > d.max_rank:
        return (f"refused: rank {served.rank} is above {d.model}'s engine.max_lora_rank {d.max_rank} "
                "(vLLM serves no larger LoRA)")
    return ""


def _young(files: Signature) -> bool:
    """Whether a file of ``files`` was written less than ``SETTLE_S`` ago."""
    return bool(files) and time.time_ns() - max(mtime for _, _, mtime, _ in files) < SETTLE_S * 1e9


class _Changing(Exception):
    """An adapter's files changed while they were read, or may still be being written."""


class _NotAnAdapter(Exception):
    """A folder's files are not a LoRA that fits its base model (the message says why)."""


def served_names(stack: AdapterStackSpec) -> tuple[str, ...]:
    """The names requests know a stack's adapters by (``vllm:lora_requests_info``'s labels): a
    folder adapter's, not the name its current content has inside the engines (``name@2``)."""
    return tuple(adapter.name.split("@", 1)[0] for adapter, _ in stack)


def names_own(model: str, stack: AdapterStackSpec) -> bool:
    """Whether a request's ``model`` names the first adapter of its ``stack`` (its own adapter:
    an adapter is never a model's or an alias's name, and one selected twice is refused)."""
    return bool(stack) and served_names(stack[:1])[0] == model


def resolve_request(svc: "Services", model: str, choices: Sequence[AdapterChoice] | None,
                    kind: str) -> tuple[ModelSpec, AdapterStackSpec]:
    """The base model's spec and the adapter stack of one request (errors as the API's 4xx; an
    unknown model is a 404 before anything is said about its adapters, and so is an adapter the
    request's key may not use: ``resolve_as``)."""
    adapters = svc.adapters
    model = svc.model_name(model)
    own = adapters.get(model)
    if own is None:
        svc.spec(model, kind)
    stack = adapters.stack_on(own, model, choices, kind)
    return svc.spec(own.model if own is not None else model, kind), stack


# -- start-up: reading and checking the configured adapters -----------------------------------------


def load_adapters(config: Config) -> AdapterRegistry:
    """Read every configured adapter of ``config`` and check it against its base model's
    checkpoint; the ``adapter_dirs`` folders are read as requests name their adapters."""
    models = {m.name: m for m in config.models}
    served = []
    for i, entry in enumerate(config.adapters):
        base = models[entry.model]
        try:
            served.append(load_adapter(entry, base.kind, base.path))
        except Exception as exc:  # noqa: BLE001 - reading files: whatever fails (safetensors' own error too) is the adapter's
            message = " ".join(str(exc).strip("'\"").split())
            raise ConfigError(f"{config.source}: adapters[{i}] ({entry.name}): {message}") from None
    dirs = [AdapterDir(d.model, models[d.model].kind, d.path, models[d.model].path, d.format,
                       _max_rank(models[d.model])) for d in config.adapter_dirs]
    return AdapterRegistry(served, dirs, [*models, *config.aliases], config.gpu.adapter_cache_budget)


def _max_rank(model) -> int | None:
    """The largest LoRA rank ``model``'s engine serves: vLLM's ``engine.max_lora_rank``; None: any."""
    engine = getattr(model, "engine", None)
    return engine.max_lora_rank if engine is not None and engine.name == "vllm" else None


def load_adapter(entry: AdapterConfig, kind: str, model_path: Path) -> ServedAdapter:
    return read_adapter(entry, kind, checkpoint_shapes(model_path, kind))


def read_adapter(entry: AdapterConfig, kind: str, shapes: dict[str, tuple[int, ...]], version: str | None = None) -> ServedAdapter:
    """``entry``'s adapter, checked against its base model's weight ``shapes``; ``version``: the
    name its content is known by inside the engines (default: its name)."""
    fmt = entry.format or detect_format(entry.path)
    internal = version or entry.name
    if fmt == "peft":
        adapter = load_peft_adapter(entry.path, name=internal)
    else:
        adapter = load_diffusers_lora(entry.path, component=_denoiser(entry.path), name=internal)
    check_fits(adapter, shapes, entry.model)
    return ServedAdapter(entry.name, entry.model, kind, fmt, entry.path, adapter, created=made_at(entry.path))


def detect_format(path: Path) -> str:
    if path.is_dir() and (path / PEFT_CONFIG).is_file():
        return "peft"
    if (path.is_dir() and (path / DIFFUSERS_WEIGHTS).is_file()) or (path.is_file() and path.suffix == ".safetensors"):
        return "diffusers"
    raise AdapterFormatError(f"{path} is neither a peft LoRA folder ({PEFT_CONFIG}) nor a diffusers LoRA "
                             f"({DIFFUSERS_WEIGHTS})")


def _denoiser(path: Path) -> str:
    """The component a diffusers LoRA file targets; LoRA on other components (text encoders) is
    refused rather than silently left out."""
    file = path / DIFFUSERS_WEIGHTS if path.is_dir() else path
    try:
        with safe_open(str(file), framework="pt") as f:
            prefixes = {k.split(".", 1)[0] for k in f.keys()}
    except SafetensorError as exc:
        raise AdapterFormatError(f"{file} is not a readable safetensors file ({exc})") from None
    named = {p for p in prefixes if p in DENOISERS or p.startswith("text_encoder")}
    others = sorted(p for p in named if p not in DENOISERS)
    if others:
        raise AdapterFormatError(f"LoRA for {', '.join(others)} is not supported (only the unet or transformer)")
    return next(iter(named), "unet")


def checkpoint_shapes(model_path: Path, kind: str) -> dict[str, tuple[int, ...]]:
    """Weight shapes by module name, read from the safetensors headers of the model (chat) or of its
    denoiser (image), without loading a tensor. Empty when the checkpoint is not safetensors."""
    folders = [model_path] if kind == "chat" else [model_path / d for d in DENOISERS]
    shapes: dict[str, tuple[int, ...]] = {}
    for folder in folders:
        for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key.endswith(".weight"):
                        shapes[key.removesuffix(".weight")] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_fits(adapter: LoraAdapter, shapes: dict[str, tuple[int, ...]], model: str) -> None:
    """Every module the adapter targets exists in ``model`` with a shape its delta fits (as the
    merge maps them: exact name, else a unique whole-component suffix)."""
    if not shapes:
        return
    for key, lm in adapter.modules.items():
        try:
            name = resolve_module(shapes, key, adapter.name)  # type: ignore[arg-type]
        except KeyError as exc:
            raise AdapterFormatError(f"does not fit model '{model}': {exc.args[0]}") from None
        shape = shapes[name]
        rows, cols = lm.up.shape[0], math.prod(lm.down.shape[1:])
        flat = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else None
        if flat not in ((rows, cols), (cols, rows)):
            raise AdapterFormatError(f"does not fit model '{model}': module {name!r} is {list(shape)}, "
                                     f"the adapter's delta {rows}x{cols}")


# -- HTTP: vLLM's runtime LoRA endpoints ---------------------------------------------------------------


class LoadLoraAdapter(_Body):
    """``POST /v1/load_lora_adapter``'s body: vLLM's fields, and which model the adapter is for."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    is_3d_lora_weight: bool = False
    base_model: str | None = None  # extension: the chat or image model; default: the only chat model


class UnloadLoraAdapter(_Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; names are unique here, so it is not needed


async def load_lora_adapter(request: Request) -> Response:
    """``POST /v1/load_lora_adapter`` (admin keys): vLLM's endpoint for adding an adapter to a
    running server (the Gateway API Inference Extension's LoRA syncer calls it), answered as vLLM
    answers: 200 with a line of text, or an error."""
    svc: Services = request.app.state.services
    svc.require_admin(request)
    body = parse(LoadLoraAdapter, await read_json(request, svc.config.limits.max_body))
    if body.is_3d_lora_weight:
        raise bad_request("3-D LoRA weights (mixture-of-experts) are not supported", "is_3d_lora_weight")
    # vLLM's own body names no model: the adapter's config may (with several chat models to choose from)
    named = None if body.base_model is not None else await asyncio.to_thread(_named_base, body.lora_path)
    spec = _base_for(svc, body.base_model, named)
    if spec.engine == "vllm" and not spec.options.get("enable_lora"):
        raise bad_request(f"the model '{spec.name}' runs on vLLM started without LoRA: give it an adapter_dirs entry "
                          "(or an adapter) in tiers.yaml so that its engine starts with LoRA", "base_model")
    path = Path(body.lora_path)
    try:
        there = path.exists()
    except (OSError, ValueError):  # a name too long for the filesystem
        there = False
    if not there:
        raise not_found(f"no LoRA adapter at '{body.lora_path[:200]}'", "lora_path", "adapter_not_found")
    base = AdapterDir(spec.name, spec.kind, path.parent, spec.path)
    await svc.adapters.load(body.lora_name, path, base, body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    """``POST /v1/unload_lora_adapter`` (admin keys): forget an adapter loaded at run time."""
    svc: Services = request.app.state.services
    svc.require_admin(request)
    body = parse(UnloadLoraAdapter, await read_json(request, svc.config.limits.max_body))
    svc.adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _named_base(lora_path: str) -> str | None:
    """The base model a peft adapter's ``adapter_config.json`` names (``base_model_name_or_path``),
    or None where it names none or cannot be read (the load itself then says why)."""
    try:
        config = json.loads((Path(lora_path) / PEFT_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    named = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return named if isinstance(named, str) and named else None


def _chat_named(svc: "Services", chats: list[ModelSpec], named: str) -> list[ModelSpec]:
    """The chat models an adapter's ``base_model_name_or_path`` names: by name (or alias), or by
    folder (absolute, or relative to tiers.yaml's folder or to the server's working folder)."""
    by_name = [s for s in chats if s.name == svc.model_name(named)]
    if by_name:
        return by_name
    try:
        folders = {(base / named).resolve() for base in (svc.config.source.parent, Path.cwd())}
        return [s for s in chats if Path(s.path).resolve() in folders]
    except (OSError, ValueError):  # not a path this system can resolve
        return []


def _base_for(svc: "Services", name: str | None, named: str | None = None) -> ModelSpec:
    """The model an adapter loaded at run time is for: ``base_model`` where given; else the only
    chat model, or the one chat model the adapter's own config (``named``) names."""
    if name is not None:
        spec = svc.arbiter.specs.get(svc.model_name(name))
        if spec is None:
            raise not_found(f"the model '{name}' does not exist", "base_model", "model_not_found")
        if spec.kind not in ("chat", "image"):
            raise bad_request(f"the model '{name}' is {a_kind(spec.kind)}; adapters are for chat and image models",
                              "base_model")
        return spec
    chats = [s for s in svc.arbiter.specs.values() if s.kind == "chat"]
    if len(chats) > 1 and named is not None:
        chats = _chat_named(svc, chats, named) or chats
    if len(chats) != 1:
        raise bad_request(f"this server has {len(chats)} chat models and the adapter's config names none of them: "
                          "name the adapter's model in 'base_model'", "base_model")
    return chats[0]


def _loaded_already(name: str) -> APIError:
    return bad_request(f"the lora adapter '{name}' has already been loaded; to load it again, set "
                       "'load_inplace' to true", "lora_name")
