"""The transformers chat worker: continuous batching is exact, shares forward passes, stops on
cancel, pauses and resumes without losing tokens."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from workers.base import ChatFinished, ChatParams, ChatRequest, ModelSpec, StepContext, TextDelta
from workers.chat import ChatWorker


@pytest.fixture(scope="module")
def worker(tiny_chat):
    w = ChatWorker(ModelSpec("tiny-chat", "chat", tiny_chat), max_num_seqs=8)
    w.load(torch.device("cpu"))
    yield w
    w.unload()


def greedy(content: str, max_tokens: int, ctx: StepContext | None = None) -> ChatRequest:
    return ChatRequest([{"role": "user", "content": content}], ChatParams(max_tokens=max_tokens, temperature=0),
                       ctx=ctx or StepContext())


async def run(worker, req) -> tuple[str, ChatFinished]:
    parts, fin = [], None
    async for ev in worker.chat(req):
        if isinstance(ev, TextDelta):
            parts.append(ev.text)
        else:
            fin = ev
    return "".join(parts), fin


# Batched rows run other kernels than a lone full forward, so their logits differ by rounding
# (measured: at most 1.6e-7 on the demo model). Greedy tokens then agree on any CPU only where the
# reference's best logit leads the runner-up by more than that; the reference checks its margin.
GREEDY_MARGIN = 1e-5


def reference_ids(worker, content: str, n: int) -> list[int]:
    """Greedy tokens by full forward passes over the whole sequence (no cache, no batching)."""
    ids = worker.encode([{"role": "user", "content": content}])
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = worker.model(torch.tensor([ids + out])).logits[0, -1]
            best, runner_up = logits.topk(2).values.tolist()
            assert best - runner_up > GREEDY_MARGIN, f"a near tie at token {len(out)} of {content!r}: pick another prompt"
            out.append(int(logits.argmax()))
    return out


def test_batched_rows_match_unbatched_reference(worker):
    """Rows of different lengths join at different steps, left-padded into one cache; every
    row's greedy tokens equal a plain full-sequence forward."""
    prompts = ["hi", "hello there, how are you doing today?", "x", "one two three four five six"]

    async def main():
        tasks = []
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(run(worker, greedy(p, 6 + 3 * i))))
            await asyncio.sleep(0.01 * i)
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    for p, (text, fin), i in zip(prompts, results, range(4)):
        ref = worker.tokenizer.decode(reference_ids(worker, p, 6 + 3 * i), skip_special_tokens=True)
        assert text == ref.rstrip("\ufffd"), p  # at the end an undecodable tail is dropped, as vLLM does
        assert fin.completion_tokens == 6 + 3 * i


class AdmittedTogether:
    """``with AdmittedTogether(worker, n) as passes``: the engine's first admission waits until
    ``n`` rows wait (so that they are admitted in one plan), and ``passes`` records each prefill
    pass: ("together", its rows' prompts) or ("alone", a prompt)."""

    def __init__(self, worker, n: int) -> None:
        self.worker, self.n, self.passes = worker, n, []

    def __enter__(self) -> list:
        worker, admit, together, alone = self.worker, self.worker._admit, self.worker._prefill_together, self.worker._prefill_into
        held = threading.Event()

        def hold(batch):
            deadline = time.monotonic() + 30
            while not held.is_set() and worker._inbox.qsize() + len(worker._waiting) < self.n and time.monotonic() < deadline:
                time.sleep(0.002)
            held.set()
            admit(batch)

        def prompt(seq) -> str:
            return seq.req.messages[-1]["content"]

        worker._admit = hold
        worker._prefill_together = lambda b, seqs: (self.passes.append(("together", [prompt(s) for s in seqs])), together(b, seqs))[1]
        worker._prefill_into = lambda b, seq: (self.passes.append(("alone", prompt(seq))), alone(b, seq))[1]
        return self.passes

    def __exit__(self, *exc) -> None:
        del self.worker._admit, self.worker._prefill_together, self.worker._prefill_into  # the class's again


def test_rows_admitted_together_share_prefill_passes_and_answer_as_each_alone(worker):
    """Six requests admitted in one plan: the plain ones are prefilled in shared passes, left-padded
    to the longest; one that scores its prompt is a pass of its own between them; one finishes in
    its prefill while the rest decode on. Each reply, its log probabilities and its prompt's
    are what the request gets alone (within 1e-4: a padded pass sums in another order)."""
    def request(content: str, **params) -> ChatRequest:
        return ChatRequest([{"role": "user", "content": content}],
                           ChatParams(**{"max_tokens": 6, "temperature": 0, "logprobs": 2, **params}), ctx=StepContext())

    asks = [("hi", {}), ("tell me about the ships", {}), ("x", {"max_tokens": 1}), ("score me", {"prompt_logprobs": 1}),
            ("two plus two", {}), ("where is the gold, friend?", {})]

    async def answer(req: ChatRequest) -> tuple[list, list[float], ChatFinished]:
        texts, logprobs, finished = [], [], None
        async for ev in worker.chat(req):
            if isinstance(ev, ChatFinished):
                finished = ev
                continue
            texts.append(ev.text)
            logprobs += [e.logprob for e in ev.logprobs or []] + [e.logprob for e in ev.prompt_logprobs or [] if e]
        return texts, logprobs, finished

    async def all_at_once() -> list:
        async with asyncio.timeout(60):
            return await asyncio.gather(*(answer(request(c, **kw)) for c, kw in asks))

    alone = [asyncio.run(answer(request(c, **kw))) for c, kw in asks]
    with AdmittedTogether(worker, len(asks)) as passes:
        together = asyncio.run(all_at_once())
    assert passes == [("together", ["hi", "tell me about the ships", "x"]), ("alone", "score me"),
                      ("together", ["two plus two", "where is the gold, friend?"])]
    for (texts, logprobs, finished), (texts_alone, logprobs_alone, finished_alone) in zip(together, alone):
        assert texts == texts_alone and finished == finished_alone
        assert logprobs == pytest.approx(logprobs_alone, abs=1e-4) and logprobs


def test_concurrent_requests_share_forward_passes(worker):
    before = worker.steps
    worker.max_rows_seen = 0  # measured by this test alone, not by the ones before it

    async def main():
        return await asyncio.gather(*[run(worker, greedy(f"q{i}", 10)) for i in range(6)])

    asyncio.run(main())
    steps = worker.steps - before
    assert worker.max_rows_seen >= 4
    assert steps < 6 * 10 // 2  # one after another would take ~60 decode steps


def test_cancel_stops_at_next_step(worker):
    ctx = StepContext()

    async def main():
        got = 0
        async for ev in worker.chat(greedy("stop me", 200, ctx)):
            if isinstance(ev, TextDelta):
                got += 1
                if got == 3:
                    break  # the consumer leaves: closing the stream cancels the row
        await asyncio.sleep(0.3)
        return got

    asyncio.run(main())
    assert ctx.cancelled
    steps_after_cancel = ctx.steps
    asyncio.run(asyncio.sleep(0.2))
    assert ctx.steps == steps_after_cancel  # it no longer advances
    assert ctx.steps < 20


def test_paused_row_resumes_with_identical_output(worker):
    """A row paused mid-generation (batch work yielding) leaves the batch keeping its tokens and
    resumes by re-prefilling; the result equals an uninterrupted run."""
    run_flag = threading.Event()
    run_flag.set()
    ctx = StepContext(pause_check=lambda: not run_flag.is_set())

    async def main():
        straight = await run(worker, greedy("resume me please", 20))
        paused_steps = []

        async def pauser():
            while ctx.steps < 5:
                await asyncio.sleep(0.005)
            run_flag.clear()
            s = ctx.steps
            await asyncio.sleep(0.3)
            paused_steps.append(ctx.steps - s)  # steps while paused (at most the one in flight)
            run_flag.set()

        p = asyncio.create_task(pauser())
        resumed = await run(worker, greedy("resume me please", 20, ctx))
        await p
        return straight, resumed, paused_steps[0]

    straight, resumed, during_pause = asyncio.run(main())
    assert resumed[0] == straight[0]
    assert resumed[1].completion_tokens == 20
    assert during_pause <= 1


def test_prompt_over_context_is_refused(worker):
    from workers.chat import ContextTooLong

    async def main():
        await run(worker, greedy("word " * 600, 10))

    with pytest.raises(ContextTooLong):
        asyncio.run(main())


def test_a_grammar_xgrammar_fails_to_compile_is_the_requests_400_and_the_worker_serves_on(worker):
    """A grammar the model's compiler fails on (a count above 128 in a schema's pattern: xgrammar
    0.2.8's check fails, mlc-ai/xgrammar#863; the gateway refuses those first) is the request's
    InvalidParam, a 400, not a 500; the next request is served."""
    import json

    from workers.base import InvalidParam, JsonGrammar

    asked = greedy("Hi", 4)
    asked.params.grammar = JsonGrammar(json.dumps({"type": "string", "pattern": "[a-z]{1,200}"}))
    with pytest.raises(InvalidParam) as refused:
        asyncio.run(run(worker, asked))
    assert refused.value.param == "response_format" and "per_rule_fsm_hashes" in str(refused.value)
    assert asyncio.run(run(worker, greedy("Hi", 4)))[1].completion_tokens == 4
    called = greedy("Hi", 4)  # a grammar made of the request's tools (forced calls) names them, not response_format
    called.params.grammar, called.params.grammar_param = asked.params.grammar, "tools"
    with pytest.raises(InvalidParam) as refused:
        asyncio.run(run(worker, called))
    assert refused.value.param == "tools"


def test_pause_ordered_during_admission_holds_the_rows_not_yet_prefilled(worker):
    """A paid arrival while batch rows are prefilled a pass each (here each scores its prompt, so
    none shares a pass): the pause takes effect between two prefills, not after every admitted row
    has been prefilled."""
    from workers.chat import _Batch, _Seq

    paused = {"now": False}
    rows = []
    for i in range(3):
        ctx = StepContext(pause_check=lambda: paused["now"])
        ids = worker.encode([{"role": "user", "content": f"row {i}"}])
        rows.append(_Seq(ids=ids, prompt_len=len(ids), params=ChatParams(max_tokens=4, temperature=0, prompt_logprobs=1),
                         emit=lambda ev: None, req=ChatRequest([], ChatParams(), ctx=ctx),
                         generator=torch.Generator(), arrival=i))
    real_prefill = worker._prefill_into
    prefills = []

    def prefill_then_pause(batch, seq):
        prefills.append(seq)
        real_prefill(batch, seq)
        paused["now"] = True  # the pause is ordered while this row was prefilling

    worker._prefill_into = prefill_then_pause
    saved, worker._waiting = worker._waiting, list(rows)
    try:
        batch = _Batch()
        worker._admit(batch)
        assert prefills == rows[:1]
        assert batch.seqs == rows[:1] and worker._waiting == rows[1:]
    finally:
        worker._prefill_into = real_prefill
        worker._waiting = saved


def test_batch_rows_prefilled_together_stop_between_layers_and_resume_together(worker):
    """Three batch rows admitted together share their prefill pass; paused after a few steps, they
    leave the batch and resume in one shared pass of their tokens; a pause ordered while that pass
    runs stops it between two layers, every row waiting with its tokens; each reply then ends as an
    uninterrupted run's."""
    from workers.chat import _decoder_layers

    prompts = ["the first batch line", "a second one", "and the third batch line of all"]
    first, second = _decoder_layers(worker.model)[:2]
    paused = threading.Event()
    contexts = [StepContext(pause_check=paused.is_set) for _ in prompts]
    state = {"armed": False, "ordered": None, "passes": 0, "reached": []}

    def after_first(module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[0] == len(prompts) and hidden.shape[1] > 1:  # a prefill pass of the three
            state["passes"] += 1
            if state["armed"] and state["ordered"] is None:
                state["ordered"] = state["passes"]
                paused.set()  # ordered while this pass runs, between its first and second layer

    def before_second(module, args):
        if args[0].shape[0] == len(prompts) and args[0].shape[1] > 1:
            state["reached"].append(state["passes"])

    async def pauses():
        while min(c.steps for c in contexts) < 3:
            await asyncio.sleep(0.002)
        paused.set()  # the rows leave the batch keeping their tokens
        await asyncio.sleep(0.1)
        state["armed"] = True
        paused.clear()  # they resume together; the order comes while their shared pass runs
        while state["ordered"] is None:
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.1)
        paused.clear()

    async def main():
        async with asyncio.timeout(60):
            paused_ = asyncio.create_task(pauses())
            replies = await asyncio.gather(*(run(worker, greedy(p, 12, c)) for p, c in zip(prompts, contexts)))
            await paused_
            return replies

    straight = [asyncio.run(run(worker, greedy(p, 12))) for p in prompts]
    hooks = [first.register_forward_hook(after_first, with_kwargs=True), second.register_forward_pre_hook(before_second)]
    try:
        with AdmittedTogether(worker, len(prompts)) as passes:
            replies = asyncio.run(main())
    finally:
        for h in hooks:
            h.remove()
    assert replies == straight
    assert all(c.paused for c in contexts)
    # first prefill, the resume the order stopped, the resume after it: each one pass of the three
    assert [p for p in passes if p[0] == "together"] == [("together", prompts)] * 3 and len(passes) == 3
    assert state["ordered"] == 2 and state["reached"] == [1, 3]  # the stopped pass never reached the second layer


def whole(req: ChatRequest) -> ChatRequest:
    req.stream = False  # the reply is read whole, like a batch line's
    return req


async def events_of(worker, req) -> list:
    return [ev async for ev in worker.chat(req)]


def test_whole_reply_holds_its_text_until_the_end(worker):
    """A reply read whole gets its first text at once (it times the first token), then the rest
    in one piece when it ends: the same text, stop strings and logprobs as the streamed reply."""
    def req(stop: list[str] | None = None) -> ChatRequest:
        return greedy("tell me everything you know", 16) if stop is None else ChatRequest(
            [{"role": "user", "content": "tell me everything you know"}],
            ChatParams(max_tokens=16, temperature=0, stop=stop, logprobs=1), ctx=StepContext())

    async def main():
        streamed = await events_of(worker, req())
        held = await events_of(worker, whole(req()))
        text = "".join(e.text for e in streamed if isinstance(e, TextDelta))
        late = next(i for i in range(3 * len(text) // 4, len(text)) if text.find(text[i:i + 2]) == i)
        stop = [text[late:late + 2]]  # met late in the reply, after several deltas
        return streamed, held, await events_of(worker, req(stop)), await events_of(worker, whole(req(stop)))

    streamed, held, streamed_stop, held_stop = asyncio.run(main())
    deltas = lambda evs: [e for e in evs if isinstance(e, TextDelta)]  # noqa: E731
    assert len(deltas(streamed)) > 4
    assert len(deltas(held)) == 2 and deltas(held)[0].text  # the first text, then the rest
    assert "".join(e.text for e in deltas(held)) == "".join(e.text for e in deltas(streamed))
    assert held[-1] == streamed[-1]  # the same finish: reason and token counts
    assert len(deltas(held_stop)) <= 3 < len(deltas(streamed_stop))
    assert "".join(e.text for e in deltas(held_stop)) == "".join(e.text for e in deltas(streamed_stop))
    assert held_stop[-1] == streamed_stop[-1] and held_stop[-1].finish_reason == "stop"
    logprobs = lambda evs: [lp.token for e in deltas(evs) for lp in e.logprobs or []]  # noqa: E731
    assert logprobs(held_stop) == logprobs(streamed_stop) and logprobs(held_stop)


@pytest.mark.parametrize("during", ["decode", "prefill"])
def test_pause_order_stops_batch_work_between_layers(worker, during):
    """Batch work whose pause is ordered while a forward pass runs stops at the next decoder layer
    (the rest of the pass does not run); its row keeps its tokens and, resumed, ends as an
    uninterrupted run does: nothing lost, nothing generated twice."""
    from workers.chat import _decoder_layers

    first, second = _decoder_layers(worker.model)[:2]
    paused = threading.Event()
    ctx = StepContext(pause_check=paused.is_set)
    calls = {"first": 0, "second": 0, "armed": False, "ordered": False}

    def after_first(module, args, kwargs, output):
        calls["first"] += 1
        tokens = (args[0] if args else kwargs["hidden_states"]).shape[1]
        right_pass = tokens == 1 and ctx.steps >= 3 if during == "decode" else tokens > 1
        if right_pass and calls["armed"] and not calls["ordered"]:
            calls["ordered"] = True
            paused.set()  # ordered while this pass runs, between its first and second layer

    def before_second(module, args):
        calls["second"] += 1

    hooks = [first.register_forward_hook(after_first, with_kwargs=True), second.register_forward_pre_hook(before_second)]

    async def lift():
        while not paused.is_set():
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.1)
        stopped = (calls["first"], calls["second"], ctx.steps)
        paused.clear()
        return stopped

    async def main():
        straight = await run(worker, greedy("stop between layers", 12))
        calls["first"] = calls["second"] = 0
        calls["armed"] = True  # the uninterrupted run is over: the next such pass is the batch row's
        lifted = asyncio.create_task(lift())
        resumed = await run(worker, greedy("stop between layers", 12, ctx))
        return straight, resumed, await lifted

    try:
        straight, resumed, (first_calls, second_calls, steps) = asyncio.run(main())
    finally:
        for h in hooks:
            h.remove()
    assert calls["ordered"] and ctx.paused
    assert first_calls == second_calls + 1  # the pass that saw the order never reached the second layer
    assert resumed == straight
    assert steps == (3 if during == "decode" else 0)  # the stopped step is not counted as one


def test_a_temperature_too_small_to_divide_by_samples_at_the_floor(worker):
    """1e-45 is 0 in float32: logits / it overflow and softmax gives NaN, which multinomial refuses
    (the request then waited forever, below). A temperature above 0 and under 0.01 samples at 0.01,
    as vLLM raises it; 0 is greedy."""
    def at(temperature: float) -> str:
        req = ChatRequest([{"role": "user", "content": "hello there"}],
                          ChatParams(max_tokens=6, temperature=temperature, seed=3), ctx=StepContext())
        return asyncio.run(asyncio.wait_for(run(worker, req), 60))[0]

    floor = at(0.01)
    assert at(1e-320) == at(1e-45) == at(0.005) == floor  # the same seed samples the same tokens
    assert at(2.0) != floor  # sampling at 2.0 is still sampling at 2.0
    assert at(0)  # greedy


@pytest.mark.parametrize("fails_at", [1, 3], ids=["first token (prefill)", "third token (decode step)"])
def test_a_row_whose_sampling_fails_gets_the_error_and_the_others_go_on(worker, monkeypatch, fails_at):
    """A row whose own sampling raises gets that error, whether it fails on the token its prefill
    samples or in a decode step; the rows beside it finish. (From the prefill the error used to
    reach no one: the row had left the waiting list and was not in the batch yet.)"""
    import workers.chat as chat

    real, calls = chat._sample, {"n": 0}

    def sample(logits, params, generator):
        if params.seed == 666:
            calls["n"] += 1
            if calls["n"] == fails_at:
                raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, generator)

    monkeypatch.setattr(chat, "_sample", sample)
    bad = ChatRequest([{"role": "user", "content": "hi"}], ChatParams(max_tokens=6, temperature=0, seed=666),
                      ctx=StepContext())

    async def main():
        others = [asyncio.create_task(run(worker, greedy(f"q{i}", 8))) for i in range(3)]
        await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match="probability tensor"):
            await asyncio.wait_for(run(worker, bad), 60)
        return await asyncio.wait_for(asyncio.gather(*others), 60)

    for text, fin in asyncio.run(main()):
        assert fin.completion_tokens == 8
    assert calls["n"] == fails_at
    assert asyncio.run(asyncio.wait_for(run(worker, greedy("after", 3)), 60))[1].completion_tokens == 3


def test_a_prefill_computes_the_last_places_logits_only_unless_the_prompt_logprobs_are_asked(worker):
    """The LM head (a prompt x vocabulary product, and its logits tensor) runs on the prefill's
    last place only (``logits_to_keep``); a request for its prompt's logprobs gets every place,
    and its first token is the same."""
    seen: list[int] = []
    hook = worker.model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(out.shape[-2]))
    try:
        prompt = "one two three four five six seven"
        n = len(worker.encode([{"role": "user", "content": prompt}]))
        text, _ = asyncio.run(run(worker, greedy(prompt, 1)))
        assert seen == [1]
        seen.clear()
        req = greedy(prompt, 1)
        req.params.prompt_logprobs = 0
        events = []

        async def collect():
            async for ev in worker.chat(req):
                events.append(ev)

        asyncio.run(collect())
        assert seen == [n]
        assert len(events[0].prompt_logprobs) == n and events[0].prompt_logprobs[0] is None
        assert "".join(ev.text for ev in events if isinstance(ev, TextDelta)) == text
    finally:
        hook.remove()


def test_a_prefill_stopped_between_layers_sends_the_prompts_logprobs_once(worker):
    """A row asking for its prompt's logprobs whose prefill a pause order stops between two
    layers sends them once, when its prefill completes after the pause, equal to an uninterrupted
    run's; its text is the same too."""
    from workers.chat import _decoder_layers

    first = _decoder_layers(worker.model)[0]
    paused = threading.Event()
    ctx = StepContext(pause_check=paused.is_set)
    state = {"armed": False, "ordered": False}

    def after_first(module, args, kwargs, output):
        tokens = (args[0] if args else kwargs["hidden_states"]).shape[1]
        if tokens > 1 and state["armed"] and not state["ordered"]:
            state["ordered"] = True
            paused.set()

    hook = first.register_forward_hook(after_first, with_kwargs=True)

    def request(c: StepContext) -> ChatRequest:
        req = greedy("score this prompt", 4, c)
        req.params.prompt_logprobs = 2
        return req

    async def events_of(req):
        return [ev async for ev in worker.chat(req)]

    async def lift():
        while not paused.is_set():
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)
        paused.clear()

    async def main():
        straight = await events_of(request(StepContext()))
        state["armed"] = True
        lifted = asyncio.create_task(lift())
        resumed = await events_of(request(ctx))
        await lifted
        return straight, resumed

    try:
        straight, resumed = asyncio.run(main())
    finally:
        hook.remove()
    assert state["ordered"] and ctx.paused
    sent = [ev.prompt_logprobs for ev in resumed if isinstance(ev, TextDelta) and ev.prompt_logprobs is not None]
    assert len(sent) == 1 and sent[0] == straight[0].prompt_logprobs and sent[0][1] is not None
    texts = ["".join(ev.text for ev in evs if isinstance(ev, TextDelta)) for evs in (straight, resumed)]
    assert texts[0] == texts[1]


def test_a_replys_text_is_decoded_one_token_at_a_time_as_the_whole_decode_reads(worker):
    """``_text`` feeds each new token to tokenizers' DecodeStream once (the whole reply was decoded
    again every step: O(n) a step): at every length its text is the whole decode's, less a
    character whose bytes have not all come (multi-byte characters split across tokens here)."""
    from types import SimpleNamespace

    text = "héllo 👋 wörld, ça va? <tool_call>{\"a\": 1}</tool_call> ok"
    ids = worker.tokenizer(text, add_special_tokens=False)["input_ids"]
    seq = SimpleNamespace(generated=ids, detok=None, decoded=0, text="", params=ChatParams())
    assert worker._streams
    for n in range(1, len(ids) + 1):
        assert worker._text(seq, n) == worker._decode(ids[:n]).rstrip("\ufffd"), n
    assert seq.text == text and seq.decoded == len(ids)
    # a held reply: decoded at its end, at once
    held = SimpleNamespace(generated=ids, detok=None, decoded=0, text="", params=ChatParams())
    assert worker._text(held, len(ids)) == text


def test_a_reply_whose_stream_refuses_a_step_or_a_tokenizer_that_cleans_spaces_is_decoded_whole(worker, monkeypatch):
    """Where the incremental decode cannot stand for the whole one (a tokenizer that cleans up
    spaces, or a step the stream refuses: its decode did not extend what it had decoded), the
    reply's text is the whole decode of its tokens, and stays so for that row."""
    from types import SimpleNamespace

    ids = worker.tokenizer("héllo wörld, ça va?", add_special_tokens=False)["input_ids"]
    whole = worker._decode(ids)

    class Refusing:
        def step(self, tokenizer, token):
            raise Exception("Invalid prefix encountered")

    seq = SimpleNamespace(generated=ids, detok=Refusing(), decoded=0, text="", params=ChatParams())
    assert worker._text(seq, len(ids)) == whole and seq.detok is None
    assert worker._text(seq, len(ids)) == whole  # decoded whole from then on
    monkeypatch.setattr(worker, "_streams", False)
    plain = SimpleNamespace(generated=ids, detok=None, decoded=0, text="", params=ChatParams())
    assert worker._text(plain, 3) == worker._decode(ids[:3]) and plain.detok is None and plain.decoded == 0


def test_a_streamed_reply_decodes_no_whole_text_per_step_and_reads_as_the_whole_decode(worker, monkeypatch):
    prompts = ["hi", "one two three four five six"]

    async def reply(p, stream):
        parts = []
        req = ChatRequest([{"role": "user", "content": p}], ChatParams(max_tokens=40, temperature=0), stream=stream)
        async for ev in worker.chat(req):
            if isinstance(ev, TextDelta):
                parts.append(ev.text)
        return "".join(parts)

    whole = []
    real = worker.tokenizer.decode
    monkeypatch.setattr(worker.tokenizer, "decode", lambda *a, **k: whole.append(1) or real(*a, **k))
    streamed = [asyncio.run(reply(p, True)) for p in prompts]
    assert len(whole) == 0  # the old path decoded the whole reply at each of its 80 tokens
    for p, text in zip(prompts, streamed):
        assert text == real(reference_ids(worker, p, 40), skip_special_tokens=True).rstrip("\ufffd")
        assert asyncio.run(reply(p, False)) == text


def test_a_decode_steps_events_reach_the_loop_in_one_wake_up(worker):
    """Four streamed rows decode together: the engine wakes the event loop once per decode step
    for all of the step's text (plus once per prefill), not once per row per step."""
    async def main():
        loop = asyncio.get_running_loop()
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **k: wakes.append(1) or real(*a, **k)
        steps = worker.steps
        try:
            async def reply(p):
                req = ChatRequest([{"role": "user", "content": p}], ChatParams(max_tokens=24, temperature=0))
                return [ev async for ev in worker.chat(req)]
            events = await asyncio.gather(*(reply(f"row {i}") for i in range(4)))
        finally:
            del loop.call_soon_threadsafe
        return len(wakes), worker.steps - steps, events

    wakes, steps, events = asyncio.run(main())
    assert all(isinstance(ev[-1], ChatFinished) and ev[-1].completion_tokens == 24 for ev in events)
    assert sum(len(ev) for ev in events) > 2 * wakes  # texts arrived several to a wake-up
    assert wakes <= steps + 4  # a wake-up per step, and one per prefill's first token


def test_a_logprobs_request_reads_the_tokens_bytes_off_the_engine_thread_once(worker, monkeypatch):
    """The tokens' own bytes (xgrammar reads the whole vocabulary: ~1 s for a real one on a slow
    core) are read before a logprobs request reaches the engine, on a thread of their own: neither
    the engine thread, whose other rows would wait, nor the event loop. They are kept per
    tokenizer folder, so the model loaded again (a fresh ``Vocabulary``) does not read them again."""
    import workers.grammar as grammar
    from tests.helpers import vocabulary_reads

    readers = vocabulary_reads(monkeypatch)
    req = lambda: ChatRequest([{"role": "user", "content": "hello"}],  # noqa: E731
                              ChatParams(max_tokens=4, temperature=0, logprobs=2), ctx=StepContext())

    async def twice():
        loop_thread = threading.current_thread().name
        events = await events_of(worker, req())
        monkeypatch.setattr(worker, "_vocab", grammar.Vocabulary(worker.tokenizer))  # as a reload makes it
        await events_of(worker, req())
        return loop_thread, events

    loop_thread, events = asyncio.run(twice())
    assert [lp.raw for e in events if isinstance(e, TextDelta) for lp in e.logprobs or []]  # bytes were given
    assert len(readers) == 1, readers  # read once for the folder
    assert readers[0] not in (loop_thread, f"chat:{worker.spec.name}")
