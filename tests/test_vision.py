"""Images in chat: a vision-language model (the demo's tiny LLaVA) reads ``image_url`` parts.

The engine's replies are checked against plain full forward passes of the same model with the
same pixels (no cache, no batching), through a pause and its re-prefill, beside text rows; the
gateway's checks (which model, which URL, which file) each with its 400; and the whole path
through the openai SDK: chat completions, streamed, the Responses API and a Batch API line.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from demo.vision import IMAGE_SIDE, PATCH
from tests.helpers import FileServer, png_claiming, run_batch, start_server, write_config
from tests.test_chat_worker import GREEDY_MARGIN, run
from workers.base import ChatParams, ChatRequest, InvalidParam, ModelSpec, StepContext
from workers.chat import ChatWorker
from workers.registry import describe

IMAGE_TOKENS = (IMAGE_SIDE // PATCH) ** 2  # per image: one per patch, the CLS token left out


def picture(seed: int, size: tuple[int, int] = (50, 40), fmt: str = "PNG") -> bytes:
    """A noise image of ``size`` (width, height), encoded as ``fmt``."""
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8")).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def asking(images: list[bytes], text: str = "What is in the picture?", max_tokens: int = 8,
           ctx: StepContext | None = None, logprobs: int | None = None) -> ChatRequest:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return ChatRequest([{"role": "user", "content": content}],
                       ChatParams(max_tokens=max_tokens, temperature=0, logprobs=logprobs),
                       ctx=ctx or StepContext(), images=tuple(images))


@pytest.fixture(scope="module")
def vlm(tiny_vlm):
    w = ChatWorker(ModelSpec("tiny-vlm", "chat", tiny_vlm), max_num_seqs=8)
    w.load(torch.device("cpu"))
    yield w
    w.unload()


def reference(worker: ChatWorker, req: ChatRequest, n: int) -> str:
    """Greedy text by full forward passes over the whole sequence, pixels given each time."""
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in req.images]
    text = worker.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
    enc = worker.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    ids, out = enc["input_ids"][0].tolist(), []
    with torch.no_grad():
        for _ in range(n):
            logits = worker.model(input_ids=torch.tensor([ids + out]), pixel_values=enc["pixel_values"]).logits[0, -1]
            best, runner_up = logits.topk(2).values.tolist()
            assert best - runner_up > GREEDY_MARGIN, f"a near tie at token {len(out)}: pick another image"
            out.append(int(logits.argmax()))
    return worker.tokenizer.decode(out, skip_special_tokens=True).rstrip("\ufffd")


def test_a_folder_with_a_vision_tower_reads_images_and_a_plain_lm_does_not(tiny_vlm, tiny_chat):
    assert describe(ModelSpec("v", "chat", tiny_vlm)).images
    assert not describe(ModelSpec("c", "chat", tiny_chat)).images
    assert not describe(ModelSpec("v", "chat", tiny_vlm, engine="vllm")).images  # not wired on vLLM


def test_the_reply_is_the_models_on_those_pixels_and_counts_the_image_tokens(vlm):
    """Each image becomes IMAGE_TOKENS prompt tokens; the reply equals full forward passes with
    the same pixels, and another picture gives other logprobs."""
    one, two = picture(1), picture(2)
    text_only = len(vlm.encode([{"role": "user", "content": "What is in the picture?"}]))

    async def main():
        return await asyncio.gather(run(vlm, asking([one])), run(vlm, asking([two])), run(vlm, asking([one, two])))

    (a, fa), (b, _), (ab, fab) = asyncio.run(main())
    assert a == reference(vlm, asking([one]), 8)
    assert b == reference(vlm, asking([two]), 8)
    assert ab == reference(vlm, asking([one, two]), 8)
    assert fa.prompt_tokens == text_only + IMAGE_TOKENS
    assert fab.prompt_tokens == text_only + 2 * IMAGE_TOKENS

    async def first_logprob(image: bytes) -> float:
        async for ev in vlm.chat(asking([image], max_tokens=1, logprobs=0)):
            return ev.logprobs[0].logprob
    assert asyncio.run(first_logprob(one)) != asyncio.run(first_logprob(two))


def test_image_rows_share_steps_with_text_rows_and_each_reads_as_alone(vlm):
    def prompts() -> list[ChatRequest]:  # new each time: a request's context is cancelled when it ends
        return [asking([picture(3)]), ChatRequest([{"role": "user", "content": "hello there"}],
                                                  ChatParams(max_tokens=8, temperature=0)), asking([picture(4)])]
    alone = [asyncio.run(run(vlm, r))[0] for r in prompts()]
    vlm.max_rows_seen = 0

    async def together():
        return await asyncio.gather(*[run(vlm, r) for r in prompts()])

    assert [text for text, _ in asyncio.run(together())] == alone
    assert vlm.max_rows_seen >= 2


def test_text_rows_on_a_vision_model_share_a_prefill_pass_and_image_rows_keep_their_own(vlm):
    """Prompts admitted together on the vision-language model: the text rows share a prefill pass
    (the language model's, left-padded), each image row has its own (its pixels go to the vision
    tower), and each reply is what the request gets alone."""
    from tests.test_chat_worker import AdmittedTogether

    def text(content: str) -> ChatRequest:
        return ChatRequest([{"role": "user", "content": content}], ChatParams(max_tokens=8, temperature=0))

    def prompts() -> list[ChatRequest]:  # new each time: a request's context is cancelled when it ends
        return [text("hello there"), text("what now, friend?"), asking([picture(5)]), text("hi"), asking([picture(6)])]

    alone = [asyncio.run(run(vlm, r))[0] for r in prompts()]

    async def together():
        return await asyncio.gather(*[run(vlm, r) for r in prompts()])

    with AdmittedTogether(vlm, 5) as passes:
        replies = [reply for reply, _ in asyncio.run(together())]
    # the image rows wait for their pixels to be prepared, so they are admitted after the text rows
    image = [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]
    assert passes == [("together", ["hello there", "what now, friend?", "hi"]), ("alone", image), ("alone", image)]
    assert replies == alone


def test_a_paused_image_row_re_prefills_with_its_pixels(vlm):
    """A batch row paused mid-reply re-prefills prompt + tokens with the image's pixels again:
    without them its image tokens would read as the placeholder's embedding."""
    go = threading.Event()
    go.set()
    ctx = StepContext(pause_check=lambda: not go.is_set())
    image = picture(5)

    async def main():
        async def pauser():
            while ctx.steps < 4:
                await asyncio.sleep(0.002)
            go.clear()
            await asyncio.sleep(0.2)
            go.set()

        p = asyncio.create_task(pauser())
        got = await run(vlm, asking([image], max_tokens=16, ctx=ctx))
        await p
        return got

    text, fin = asyncio.run(main())
    assert ctx.paused
    assert fin.completion_tokens == 16
    assert text == reference(vlm, asking([image]), 16)


def test_images_for_a_text_model_or_pixels_that_do_not_decode_are_refused(vlm, tiny_chat):
    plain = ChatWorker(ModelSpec("tiny-chat", "chat", tiny_chat))
    plain.load(torch.device("cpu"))
    try:
        with pytest.raises(InvalidParam, match="reads text only"):
            asyncio.run(run(plain, asking([picture(1)])))
    finally:
        plain.unload()
    cut = picture(6)[:200]  # a PNG header with its pixels cut short
    with pytest.raises(InvalidParam, match="cannot be decoded") as caught:
        asyncio.run(run(vlm, asking([cut])))
    assert caught.value.param == "messages"


# -- over HTTP ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_vlm, tiny_chat, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-server")
    extra = "limits:\n  max_chat_tokens: 64\n  chat_max_images: 2\n"
    s = start_server(write_config(folder, {"tiny-vlm": ("chat", tiny_vlm), "tiny-chat": ("chat", tiny_chat)}, extra))
    yield s
    s.stop()


def client(server, tier: str = "paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0)


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}


TEXT = {"type": "text", "text": "What is in the picture?"}
TEXT_IN = {"type": "input_text", "text": TEXT["text"]}


def test_the_openai_sdk_sends_an_image_and_gets_the_models_reply(server, vlm):
    image = picture(7)
    c = client(server)
    got = c.chat.completions.create(model="tiny-vlm", messages=user(image_part(data_url(image)), TEXT),
                                    max_tokens=8, temperature=0)
    expected = asking([image])
    expected.messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT["text"]}]}]
    assert got.choices[0].message.content == reference(vlm, expected, 8)
    text_only = len(vlm.encode([{"role": "user", "content": TEXT["text"]}]))
    assert got.usage.prompt_tokens == text_only + IMAGE_TOKENS
    streamed = c.chat.completions.create(model="tiny-vlm", messages=user(image_part(data_url(image)), TEXT),
                                         max_tokens=8, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == got.choices[0].message.content
    jpeg = c.chat.completions.create(model="tiny-vlm", max_tokens=2, temperature=0,
                                     messages=user(image_part(data_url(picture(7, fmt="JPEG"), "image/jpeg")), TEXT))
    assert jpeg.usage.prompt_tokens == text_only + IMAGE_TOKENS


def test_the_responses_api_takes_input_image_parts(server, vlm):
    image = picture(8)
    c = client(server)
    got = c.responses.create(model="tiny-vlm", max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(image), "detail": "auto"},
                                     {"type": "input_text", "text": TEXT["text"]}]}])
    assert got.output_text == reference(vlm, asking([image]), 8)
    counted = c.responses.input_tokens.count(model="tiny-vlm", input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(image)},
                                     {"type": "input_text", "text": TEXT["text"]}]}])
    assert counted.input_tokens == got.usage.input_tokens == len(vlm.encode([
        {"role": "user", "content": TEXT["text"]}])) + IMAGE_TOKENS
    with pytest.raises(openai.NotFoundError) as caught:
        c.responses.create(model="tiny-vlm", input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-abc"}, {"type": "input_text", "text": "x"}]}])
    assert (caught.value.body["param"], caught.value.body["code"]) == ("input[0].content[0].file_id", "file_not_found")
    for content, param, code in [
        ([{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": "https://example.com/a.png"}],
         "input[0].content[1].image_url", "image_url_not_fetched"),
        ([{"type": "input_image", "image_url": data_url(b"GIF89a")}], "input[0].content[0].image_url", "invalid_image"),
        ([{"type": "input_image", "image_url": data_url(image)}, {"type": "input_text", "text": 5}], "input[0].content[1]",
         "invalid_type")]:
        with pytest.raises(openai.BadRequestError) as caught:
            c.responses.create(model="tiny-vlm", input=[{"role": "user", "content": content}])
        assert (caught.value.body["param"], caught.value.body["code"]) == (param, code)
    with pytest.raises(openai.BadRequestError) as caught:  # a text-only model: named at the input item
        c.responses.create(model="tiny-chat", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": data_url(image)}]}])
    assert (caught.value.body["param"], caught.value.body["code"]) == ("input[0].content[1].type",
                                                                       "image_input_not_supported")


def test_a_responses_image_error_names_its_input_item(server):
    """An image refused by chat's checks (too many, a bad ``detail``, a long data: URL that is not
    an image) is named as the request names it, ``input[i].content[j]...``, whatever comes before
    it (instructions, earlier items), not ``input.content[j]``; too many images counted with those
    of the response it continues says so."""
    c = client(server)
    image = {"type": "input_image", "image_url": data_url(picture(3))}
    earlier = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
    not_image = {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(b"x" * 70_000).decode()}
    for kw, param, code in [
        ({"input": earlier + [{"role": "user", "content": [image] * 3}]}, "input[2].content[2]", "too_many_images"),
        ({"input": earlier + [{"role": "user", "content": [TEXT_IN, {**image, "detail": "bogus"}]}]},
         "input[2].content[1].detail", "invalid_value"),
        ({"instructions": "Be brief.", "input": earlier + [{"role": "user", "content": [TEXT_IN, not_image]}]},
         "input[2].content[1].image_url", "invalid_image"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            c.responses.create(model="tiny-vlm", max_output_tokens=1, **kw)
        assert (caught.value.body["param"], caught.value.body.get("code")) == (param, code), kw
    first = c.responses.create(model="tiny-vlm", max_output_tokens=1, input=[{"role": "user", "content": [image] * 2}])
    with pytest.raises(openai.BadRequestError) as caught:
        c.responses.create(model="tiny-vlm", max_output_tokens=1, previous_response_id=first.id,
                           input=[{"role": "user", "content": [TEXT_IN, image]}])
    assert (caught.value.body["param"], caught.value.body["code"]) == ("input[0].content[1]", "too_many_images")
    assert "the prompt has 3 images" in caught.value.body["message"]
    assert "previous response it continues" in caught.value.body["message"]


def test_an_input_image_may_name_an_uploaded_file(server, vlm):
    """``{"type": "input_image", "file_id": ...}``: the caller's file of purpose ``vision`` (or
    ``user_data``) is read as the same image sent inline; the input items keep the file's id; a
    conversation's items may name one too. Another key's file, a file of another purpose, or one
    that is not an image is refused naming the part."""
    image = picture(8)
    c = client(server)
    f = c.files.create(file=("cat.png", io.BytesIO(image)), purpose="vision")

    def ask(part: dict, key=c, **kw):
        return key.responses.create(model="tiny-vlm", max_output_tokens=8, temperature=0, **kw, input=[
            {"role": "user", "content": [part, {"type": "input_text", "text": TEXT["text"]}]}])

    got = ask({"type": "input_image", "file_id": f.id, "detail": "auto"})
    inline = ask({"type": "input_image", "image_url": data_url(image)})
    assert got.output_text == inline.output_text == reference(vlm, asking([image]), 8)
    assert got.usage.input_tokens == inline.usage.input_tokens
    (item,) = c.responses.input_items.list(got.id).data
    assert item.content[0].file_id == f.id and item.content[0].image_url is None  # listed as it was sent
    later, later_inline = (c.responses.create(model="tiny-vlm", previous_response_id=r.id, input="And now?",
                                              max_output_tokens=1) for r in (got, inline))
    assert later.usage.input_tokens == later_inline.usage.input_tokens  # the image read again, as the inline one is

    jpeg = picture(7, fmt="JPEG")
    user_data = c.files.create(file=("cat.jpg", io.BytesIO(jpeg)), purpose="user_data")
    assert ask({"type": "input_image", "file_id": user_data.id}).output_text == \
        ask({"type": "input_image", "image_url": data_url(jpeg, "image/jpeg")}).output_text
    def in_conversation(part: dict):
        conversation = c.conversations.create(items=[{"type": "message", "role": "user", "content": [
            part, {"type": "input_text", "text": TEXT["text"]}]}])
        return c.responses.create(model="tiny-vlm", conversation=conversation.id, input="And now?", max_output_tokens=3,
                                  temperature=0)

    kept, kept_inline = in_conversation({"type": "input_image", "file_id": f.id}), \
        in_conversation({"type": "input_image", "image_url": data_url(image)})
    assert (kept.usage.input_tokens, kept.output_text) == (kept_inline.usage.input_tokens, kept_inline.output_text)

    text = c.files.create(file=("notes.txt", io.BytesIO(b"not a picture")), purpose="user_data")
    tune = c.files.create(file=("t.jsonl", io.BytesIO(b'{"messages": []}')), purpose="fine-tune")
    for key, file_id, error, code in [
        (client(server, "free"), f.id, openai.NotFoundError, "file_not_found"),  # another key's file: not found
        (c, text.id, openai.BadRequestError, "invalid_image_format"),
        (c, tune.id, openai.BadRequestError, "invalid_file_purpose"),
    ]:
        with pytest.raises(error) as caught:
            ask({"type": "input_image", "file_id": file_id}, key)
        assert (caught.value.body["param"], caught.value.body["code"]) == ("input[0].content[0].file_id", code)
    with pytest.raises(openai.NotFoundError) as caught:  # a conversation's items are checked when added
        client(server, "free").conversations.create(items=[{"type": "message", "role": "user", "content": [
            {"type": "input_image", "file_id": f.id}]}])
    assert caught.value.body["param"] == "items[0].content[0].file_id"
    with pytest.raises(openai.BadRequestError) as caught:  # a vision file is an image
        c.files.create(file=("notes.txt", io.BytesIO(b"not a picture")), purpose="vision")
    assert caught.value.body["code"] == "invalid_file"
    c.files.delete(f.id)  # read again by a response that continues it: not kept in the stored response
    with pytest.raises(openai.NotFoundError) as caught:
        c.responses.create(model="tiny-vlm", previous_response_id=got.id, input="And now?", max_output_tokens=1)
    assert (caught.value.body["param"], caught.value.body["code"]) == \
        ("previous_response_id[0].content[0].file_id", "file_not_found")


def test_a_vision_file_past_pillows_bomb_guard_is_an_image_too_large_to_read(server):
    """A PNG whose header says 20000x20000 is an image (a file of purpose ``vision`` is taken, as a
    5000x5000 one is) and too large where it is read: ``image_too_large`` naming the part. Pillow's
    bomb guard raised in ``image_type`` and the upload was a 500."""
    c = client(server)
    f = c.files.create(file=("huge.png", io.BytesIO(png_claiming(20_000, 20_000))), purpose="vision")
    with pytest.raises(openai.BadRequestError) as caught:
        c.responses.create(model="tiny-vlm", max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": f.id}, {"type": "input_text", "text": TEXT["text"]}]}])
    assert (caught.value.body["param"], caught.value.body["code"]) == ("input[0].content[0].image_url",
                                                                       "image_too_large")


def test_a_batch_line_with_an_image_is_answered_as_the_endpoint_answers(server):
    c = client(server, "batch")
    body = {"model": "tiny-vlm", "messages": user(image_part(data_url(picture(9))), TEXT), "max_tokens": 6,
            "temperature": 0}
    direct = client(server).chat.completions.create(**body).choices[0].message.content
    batch = run_batch(c, "/v1/chat/completions", [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                                   "body": body}])
    assert batch.status == "completed" and batch.request_counts.completed == 1
    line = c.files.content(batch.output_file_id).text.strip()
    import json
    assert json.loads(line)["response"]["body"]["choices"][0]["message"]["content"] == direct


def _gif(frames: int) -> bytes:
    out = io.BytesIO()
    images = [Image.new("RGB", (8, 8), (80 * i, 0, 0)) for i in range(frames)]
    images[0].save(out, "GIF", save_all=True, append_images=images[1:])
    return out.getvalue()


@pytest.mark.parametrize("model, messages, status, param, code", [
    ("tiny-chat", user(TEXT, image_part(data_url(picture(1)))), 400, "messages[0].content[1].type",
     "image_input_not_supported"),
    ("tiny-vlm", user(image_part("https://example.com/cat.png"), TEXT), 400, "messages[0].content[0].image_url.url",
     "image_url_not_fetched"),
    ("tiny-vlm", user(image_part("data:image/png;base64,@@@"), TEXT), 400, "messages[0].content[0].image_url.url",
     "invalid_image_url"),
    ("tiny-vlm", user(image_part("data:text/plain;base64,aGk="), TEXT), 400, "messages[0].content[0].image_url.url",
     "invalid_image_url"),
    ("tiny-vlm", user(image_part("/tmp/cat.png"), TEXT), 400, "messages[0].content[0].image_url.url", "invalid_image_url"),
    ("tiny-vlm", user(image_part(data_url(b"not an image at all")), TEXT), 400,
     "messages[0].content[0].image_url.url", "invalid_image"),
    ("tiny-vlm", user(image_part(data_url(picture(1, fmt="BMP"), "image/bmp")), TEXT), 400,
     "messages[0].content[0].image_url.url", "invalid_image_format"),
    ("tiny-vlm", user(image_part(data_url(_gif(3), "image/gif")), TEXT), 400, "messages[0].content[0].image_url.url",
     "invalid_image_format"),
    # a header past Pillow's bomb guard (2 x 89.5M pixels): too large, not damaged (was invalid_image)
    ("tiny-vlm", user(image_part(data_url(png_claiming(20_000, 20_000))), TEXT), 400,
     "messages[0].content[0].image_url.url", "image_too_large"),
    # within 4096 x 4096 pixels in all, but past 4096 a side: the processor would scale it to 131072 x 32
    ("tiny-vlm", user(image_part(data_url(picture(2, size=(4097, 1)))), TEXT), 400,
     "messages[0].content[0].image_url.url", "image_too_large"),
    ("tiny-vlm", user(TEXT, *[image_part(data_url(picture(i))) for i in range(3)]), 400, "messages[0].content[3]",
     "too_many_images"),
    ("tiny-vlm", [{"role": "system", "content": [image_part(data_url(picture(1)))]}, {"role": "user", "content": "hi"}],
     400, "messages[0].content[0].type", "invalid_value"),
    ("tiny-vlm", user({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}), 400, "messages[0].content",
     None),
])
def test_what_cannot_be_read_as_an_image_gets_a_400_naming_the_part(server, model, messages, status, param, code):
    with pytest.raises(openai.APIStatusError) as caught:
        client(server).chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert caught.value.status_code == status
    err = caught.value.body
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"]


def test_an_image_cut_short_is_refused_before_admission_naming_the_part(server):
    """A PNG or JPEG whose header reads but whose data is cut short has its pixels decoded before
    the request is admitted: a 400 ``invalid_image`` naming the part, as a file that is not an
    image gets, with nothing metered (it failed in the engine, named ``messages``, after it was)."""
    import httpx

    c = client(server, "subscriber")

    def usage() -> list[dict]:
        return httpx.get(f"{server.base_url}/usage", headers={"Authorization": f"Bearer {server.keys['subscriber']}"},
                         timeout=30).json()["data"]

    before = usage()
    for fmt, media in [("PNG", "image/png"), ("JPEG", "image/jpeg")]:
        whole = picture(5, size=(64, 64), fmt=fmt)
        cut = data_url(whole[:len(whole) // 2], media)
        with pytest.raises(openai.BadRequestError) as caught:
            c.chat.completions.create(model="tiny-vlm", max_tokens=2, messages=user(TEXT, image_part(cut)))
        assert (caught.value.body["param"], caught.value.body["code"]) == \
            ("messages[0].content[1].image_url.url", "invalid_image"), fmt
        with pytest.raises(openai.BadRequestError) as caught:
            c.responses.create(model="tiny-vlm", max_output_tokens=2, input=[{"role": "user", "content": [
                TEXT_IN, {"type": "input_image", "image_url": cut}]}])
        assert (caught.value.body["param"], caught.value.body["code"]) == \
            ("input[0].content[1].image_url", "invalid_image")
    assert usage() == before


def test_text_that_spells_the_image_placeholder_is_a_400_not_a_request_that_never_ends(server):
    """A text part holding the model's own placeholder (``<image>``) beside an image part leaves
    the processor more placeholders than images: a 400 naming the messages (the processor's
    StopIteration, out of its thread, never reached the request's future: it waited forever),
    on chat and where a Responses request's tokens are counted."""
    c = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=60)
    url = data_url(picture(3))
    with pytest.raises(openai.BadRequestError) as caught:
        c.chat.completions.create(model="tiny-vlm", max_tokens=2,
                                  messages=user({"type": "text", "text": "<image> and"}, image_part(url)))
    assert caught.value.body["param"] == "messages" and "<image>" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        c.responses.input_tokens.count(model="tiny-vlm", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "<image>"}, {"type": "input_image", "image_url": url}]}])
    assert caught.value.body["param"] == "input"


def test_an_animated_png_or_webp_is_refused_as_what_it_is(server):
    """An animated PNG or WebP is refused as a GIF of several frames is (the processor would read
    one frame), its message naming its own format, not a GIF."""
    frames = [Image.new("RGB", (8, 8), (80 * i, 0, 0)) for i in range(2)]
    for fmt, media in [("PNG", "image/png"), ("WEBP", "image/webp")]:
        out = io.BytesIO()
        frames[0].save(out, fmt, save_all=True, append_images=frames[1:])
        with pytest.raises(openai.BadRequestError) as caught:
            client(server).chat.completions.create(model="tiny-vlm", max_tokens=2,
                                                   messages=user(image_part(data_url(out.getvalue(), media)), TEXT))
        assert caught.value.body["code"] == "invalid_image_format"
        assert f"animated {fmt} (2 frames)" in caught.value.body["message"], fmt


def test_a_single_frame_gif_is_read(server, vlm):
    got = client(server).chat.completions.create(model="tiny-vlm", max_tokens=2,
                                                 messages=user(image_part(data_url(_gif(1), "image/gif")), TEXT))
    assert got.usage.prompt_tokens == len(vlm.encode([{"role": "user", "content": TEXT["text"]}])) + IMAGE_TOKENS


def test_a_stored_completion_lists_its_image_part(server):
    c = client(server)
    url = data_url(picture(10))
    done = c.chat.completions.create(model="tiny-vlm", messages=user(image_part(url), TEXT), max_tokens=2, store=True)
    listed = c.chat.completions.messages.list(done.id)
    parts = listed.data[0].content_parts
    assert [p.type for p in parts] == ["image_url", "text"]
    assert parts[0].image_url.url == url


# -- image URLs on listed hosts -----------------------------------------------------------------------

def test_only_listed_hosts_are_fetched_and_a_star_covers_subdomains():
    from gateway.errors import APIError
    from gateway.vision import PendingImage, read_image_url

    hosts = ["*.example.com", "images.test"]
    for url in ("https://a.example.com/x.png", "http://b.a.example.com:8080/x.png", "https://IMAGES.test/y.jpg",
                "HTTPS://a.example.com/x.png"):  # a scheme in any case (it was refused as not a data: URL)
        assert read_image_url(url, "p", hosts) == PendingImage(url, "p")
    for url in ("https://example.com/x.png", "https://evil.test/a.example.com/x.png", "https://images.test.evil/x",
                "https://a.example.com.evil/x.png", "https://a.example.com@evil.test/x.png"):
        with pytest.raises(APIError) as caught:
            read_image_url(url, "p", hosts)
        assert caught.value.code == "image_url_not_fetched", url


@pytest.fixture(scope="module")
def fetching(tiny_vlm, tmp_path_factory):
    images = FileServer({"/cat.png": picture(11), "/big.png": picture(12, size=(400, 400)), "/text": b"hello"})
    folder = tmp_path_factory.mktemp("vision-fetching")
    extra = ("limits:\n  max_chat_tokens: 64\n  image_fetch_timeout_s: 1\n  image_fetch_max_bytes: 64KiB\n"
             "server:\n  image_url_hosts: ['127.0.0.1']\n")
    s = start_server(write_config(folder, {"tiny-vlm": ("chat", tiny_vlm)}, extra))
    yield s, images
    s.stop()
    images.httpd.shutdown()


def test_an_image_url_on_a_listed_host_is_fetched_and_read_as_the_same_bytes_inline(fetching):
    s, images = fetching
    c = client(s)

    def ask(url: str) -> str:
        return c.chat.completions.create(model="tiny-vlm", messages=user(image_part(url), TEXT), max_tokens=6,
                                         temperature=0).choices[0].message.content

    assert ask(f"{images.url}/cat.png") == ask(data_url(images.files["/cat.png"]))
    got = c.responses.create(model="tiny-vlm", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": f"{images.url}/cat.png"},
                                     {"type": "input_text", "text": TEXT["text"]}]}])
    assert got.output_text == ask(f"{images.url}/cat.png")


@pytest.mark.parametrize("path, code, says", [
    ("/missing.png", "image_url_fetch_failed", "answered 404"),
    ("/moved", "image_url_fetch_failed", "redirect"),
    ("/slow", "image_url_fetch_failed", "within 1 s"),
    ("/big.png", "image_too_large", "larger than"),
    ("/text", "invalid_image", "image"),
])
def test_a_fetch_that_fails_is_a_400_naming_the_part(fetching, path, code, says):
    s, images = fetching
    with pytest.raises(openai.BadRequestError) as caught:
        client(s).chat.completions.create(model="tiny-vlm", max_tokens=2,
                                          messages=user(TEXT, image_part(images.url + path)))
    err = caught.value.body
    assert (err["param"], err["code"]) == ("messages[0].content[1].image_url.url", code), err
    assert says in err["message"]


def test_a_host_not_listed_is_not_fetched(fetching):
    s, images = fetching
    with pytest.raises(openai.BadRequestError) as caught:
        client(s).chat.completions.create(model="tiny-vlm", max_tokens=2, messages=user(
            image_part(images.url.replace("127.0.0.1", "localhost") + "/cat.png"), TEXT))
    assert caught.value.body["code"] == "image_url_not_fetched"


def test_an_image_kept_in_a_conversation_is_read_again_by_the_next_response(server, vlm):
    c = client(server)
    image = [{"type": "input_image", "image_url": data_url(picture(13))}, {"type": "input_text", "text": "Look."}]
    conversation = c.conversations.create(items=[{"type": "message", "role": "user", "content": image}])
    got = c.responses.create(model="tiny-vlm", conversation=conversation.id, input="And now?", max_output_tokens=2)
    without = c.responses.create(model="tiny-vlm", input=[{"role": "user", "content": "Look."},
                                                          {"role": "user", "content": "And now?"}], max_output_tokens=2)
    assert got.usage.input_tokens == without.usage.input_tokens + IMAGE_TOKENS
    listed = c.conversations.items.list(conversation.id, order="asc").data
    assert listed[0].content[0].type == "input_image"


def test_a_long_data_url_is_decoded_off_the_event_loop_and_read_the_same(server):
    """Past INLINE_DECODE characters of base64 the URL is left pending (decoded on a thread
    before admission): the reply is the same as for the same pixels in a short file, and bad
    base64 deep in it is still a 400 naming the part."""
    from gateway.vision import INLINE_DECODE, PendingImage, read_image_url

    small = picture(14, size=(32, 32))
    pixels = Image.open(io.BytesIO(small))
    big = io.BytesIO()
    pixels.save(big, "PNG", compress_level=0, pnginfo=_padding(INLINE_DECODE))  # the same pixels, a longer file
    long_url = data_url(big.getvalue())
    assert len(long_url) > INLINE_DECODE
    assert isinstance(read_image_url(long_url, "p"), PendingImage)
    assert isinstance(read_image_url(data_url(small), "p"), bytes)
    c = client(server)

    def ask(url: str) -> str:
        return c.chat.completions.create(model="tiny-vlm", messages=user(image_part(url), TEXT), max_tokens=6,
                                         temperature=0).choices[0].message.content

    assert ask(long_url) == ask(data_url(small))
    broken = long_url[:-100] + "!" + long_url[-99:]
    with pytest.raises(openai.BadRequestError) as caught:
        ask(broken)
    assert (caught.value.body["param"], caught.value.body["code"]) == ("messages[0].content[0].image_url.url",
                                                                       "invalid_image_url")


def _padding(size: int):
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("padding", "x" * size)
    return info


def test_langchains_chat_openai_sends_an_image_message(server):
    """LangChain's ChatOpenAI with a content-block message (how applications send images)."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    url = data_url(picture(15))
    llm = ChatOpenAI(model="tiny-vlm", base_url=server.base_url, api_key=server.keys["paid"], max_tokens=6,
                     temperature=0, max_retries=0)
    got = llm.invoke([HumanMessage(content=[TEXT, {"type": "image_url", "image_url": {"url": url}}])])
    direct = client(server).chat.completions.create(model="tiny-vlm", messages=user(TEXT, image_part(url)),
                                                    max_tokens=6, temperature=0)
    assert got.content == direct.choices[0].message.content
    assert got.usage_metadata["input_tokens"] == direct.usage.prompt_tokens


def test_truncation_auto_counts_each_image_as_its_tokens(fetching, vlm):
    """Eight turns with an image each, whose text alone fits the context and whose images do not:
    without truncation the engine refuses it; with ``auto`` the oldest turns go until the images'
    tokens fit too."""
    s, _ = fetching
    c = client(s)
    room = vlm.context_length - 8  # max_output_tokens 8

    def turns(words: int) -> list[dict]:
        items = []
        for t in range(8):
            text = "x " * words if t == 0 else "One, two, three, four, five, six, seven, eight, nine, ten. " * 3
            items.append({"role": "user", "content": [{"type": "input_image", "image_url": data_url(picture(20 + t))},
                                                      {"type": "input_text", "text": text}]})
            if t < 7:
                items.append({"role": "assistant", "content": "ok"})
        return items

    def placeholders(items: list[dict]) -> int:  # the prompt's tokens with each image as its one placeholder
        return len(vlm.encode([{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else [
            {"type": "image"} if p["type"] == "input_image" else {"type": "text", "text": p["text"]}
            for p in m["content"]]} for m in items]))

    words = 1
    while placeholders(turns(words)) + 8 * (IMAGE_TOKENS - 1) <= room:
        words += 1
    items = turns(words)
    assert placeholders(items) <= room < placeholders(items) + 8 * (IMAGE_TOKENS - 1)
    with pytest.raises(openai.BadRequestError) as caught:
        c.responses.create(model="tiny-vlm", input=items, max_output_tokens=8)
    assert caught.value.body["code"] == "context_length_exceeded"
    cut = c.responses.create(model="tiny-vlm", input=items, max_output_tokens=8, truncation="auto", temperature=0)
    assert cut.status in ("completed", "incomplete") and cut.usage.input_tokens <= room
    kept = next(items[k:] for k in range(2, len(items), 2)  # the turns it kept: the same prompt, its images too
                if placeholders(items[k:]) + (len(items[k:]) + 1) // 2 * (IMAGE_TOKENS - 1) == cut.usage.input_tokens)
    alone = c.responses.create(model="tiny-vlm", input=kept, max_output_tokens=8, temperature=0)
    assert (alone.output_text, alone.usage.input_tokens) == (cut.output_text, cut.usage.input_tokens)
    assert c.responses.input_tokens.count(model="tiny-vlm", input=items, truncation="auto").input_tokens \
        == cut.usage.input_tokens


def test_a_vision_model_with_image_dependent_positions_is_refused_at_load(tiny_vlm, tmp_path):
    """M-RoPE (Qwen2-VL's positions from the image's grid) would be wrong in the engine's decode
    steps, which count positions by tokens: such a folder does not load, with a message saying why."""
    import json
    import shutil

    folder = tmp_path / "mrope"
    shutil.copytree(tiny_vlm, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 7, 7]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="M-RoPE"):
        ChatWorker(ModelSpec("mrope", "chat", folder)).load(torch.device("cpu"))


def test_the_n_choices_of_a_request_share_one_preparation_of_its_images(server, vlm, monkeypatch):
    """n choices are n rows of the engine: they decode the images and run the processor once,
    and each reads as a request of one choice does."""
    from workers import chat_prompt

    calls = []
    real = chat_prompt.vision_inputs

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(chat_prompt, "vision_inputs", counted)
    body = {"model": "tiny-vlm", "messages": user(image_part(data_url(picture(16))), TEXT), "max_tokens": 6,
            "temperature": 0}
    c = client(server)
    three = c.chat.completions.create(**body, n=3)
    assert len(calls) == 1
    one = c.chat.completions.create(**body)
    assert len(calls) == 2  # a new request prepares its own: nothing is kept after the choices have it
    assert [ch.message.content for ch in three.choices] == [one.choices[0].message.content] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
