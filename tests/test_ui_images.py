"""Images on the chat page, in a real browser (headless Chromium through selenium, as
tests/test_ui_browser.py drives it, whose server and browser helpers these reuse).

Most cases run on ``image_app``: the chat UI and a fake model whose ``/v1/models`` lists the
capabilities a case sets (``"vision"`` or not) and whose ``/v1/chat/completions`` records each
request and answers with the number of images it got (or refuses them with a 400, as a server
does for a bad image). One case runs the real server over the random-weight SmolVLM of
``tiny_smolvlm``.

The page sends a user message with images as OpenAI content parts, ``[{"type": "text", "text":
...}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}, ...]``, and keeps
the images with the conversation (``images`` of the message in the store).
"""
from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from conftest import random_image  # noqa: E402
from llaisys.server import ui  # noqa: E402
from test_ui_browser import (WAIT, LiveServer, RequestLog, answer_done, conversation, css, fake_service,  # noqa: E402
                             new_driver, open_page, path_messages, real_app, reload, send, wait)

TEXT_ONLY = "takes text only"


# ---------------------------------------------------------------- the app under test

def image_parts(message: dict[str, Any]) -> list[str]:
    """The data URLs of a chat message's image_url parts."""
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [p["image_url"]["url"] for p in content if p.get("type") == "image_url"]


def image_app(db_path: Path) -> FastAPI:
    """``ui.mount`` and a fake vision model: ``app.state.capabilities`` is what /v1/models lists
    (None: no capabilities at all), ``app.state.refusal`` a message to refuse images with (400)."""
    app = FastAPI()
    ui.mount(app, SimpleNamespace(db_path=db_path, api_key=None))
    app.state.service = fake_service()
    app.state.capabilities = {"chat": True, "vision": True}
    app.state.refusal = None
    app.state.requests = []

    @app.get("/v1/models")
    async def models() -> Any:
        model = {"id": "fake-vlm", "object": "model"}
        if app.state.capabilities is not None:
            model["capabilities"] = app.state.capabilities
        return {"object": "list", "data": [model]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        await request.json()
        return {"count": 100, "max_model_len": app.state.service.max_model_len, "tokens": [], "token_strs": None}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        app.state.requests.append(body)
        seen = sum(len(image_parts(m)) for m in body["messages"])
        if seen and app.state.refusal:
            error = {"message": app.state.refusal, "type": "invalid_request_error",
                     "param": "messages[0].content[1]", "code": None}
            return JSONResponse({"error": error}, 400)
        last = body["messages"][-1]["content"]
        text = last if isinstance(last, str) else " ".join(p["text"] for p in last if p["type"] == "text")
        words = f"I see {len(image_parts(body['messages'][-1]))} image(s) here, {seen} in all: {text}".split(" ")

        async def events() -> Any:
            for k, word in enumerate(words):
                delta = {"content": (" " if k else "") + word}
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': None}]})}\n\n"
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
            usage = {"prompt_tokens": 9, "completion_tokens": len(words), "total_tokens": 9 + len(words)}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer(image_app(tmp_path_factory.mktemp("ui-images") / "chat.sqlite3"))
    yield server
    server.stop()


@pytest.fixture
def app_state(live: LiveServer) -> Iterator[Any]:
    """The fake's settings, put back after each case."""
    yield live.app.state
    live.app.state.capabilities = {"chat": True, "vision": True}
    live.app.state.refusal = None


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    d = new_driver()
    yield d
    d.quit()


# ---------------------------------------------------------------- helpers

def picture(tmp_path: Path, name: str, size: tuple[int, int] = (48, 32), seed: int = 0) -> Path:
    """A picture of random pixels saved as ``tmp_path/name`` (the suffix says the format)."""
    path = tmp_path / name
    random_image(np.random.default_rng(seed), *size).save(path)
    return path


def data_url(path: Path, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(path.read_bytes()).decode()}"


def vision_ready(driver: Any) -> None:
    """Wait for the page to know that the model takes images (the attach button turns on)."""
    wait(driver, lambda d: css(d, "#attach")[0].is_enabled(), "the attach button to turn on")


def attach(driver: Any, *paths: Path) -> None:
    """Choose ``paths`` in the attach button's file dialog (its input, shown for selenium)."""
    field = css(driver, "#attach-file")[0]
    driver.execute_script("arguments[0].hidden = false", field)
    field.send_keys("\n".join(str(p) for p in paths))
    driver.execute_script("arguments[0].hidden = true", field)


def thumbnails(driver: Any) -> list[str]:
    """The composer's attached images (their data URLs)."""
    return [img.get_attribute("src") for img in css(driver, "#attachments .thumb img")]


def thread_images(driver: Any) -> list[list[str]]:
    """The images of each user message on screen, each loaded (the CSP lets data: URLs show)."""
    out = []
    for msg in css(driver, ".msg.user"):
        imgs = msg.find_elements("css selector", ".msg-images img.msg-image")
        assert all(driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", i)
                   for i in imgs), "an image in the thread did not load"
        out.append([i.get_attribute("src") for i in imgs])
    return out


def notice(driver: Any, *words: str) -> str:
    """Wait for an error notice holding ``words``; its text."""
    wait(driver, lambda d: css(d, "#notice.error") and all(w in css(d, "#notice")[0].text for w in words),
         f"a notice saying {words}")
    return css(driver, "#notice")[0].text


DROP = """
    const [target, kind, files] = arguments;
    const data = new DataTransfer();
    for (const [name, type, b64] of files) {
      data.items.add(new File([Uint8Array.from(atob(b64), (c) => c.charCodeAt(0))], name, { type }));
    }
    const init = { bubbles: true, cancelable: true };
    const event = kind === "paste" ? new ClipboardEvent("paste", Object.assign({ clipboardData: data }, init))
                                   : new DragEvent(kind, Object.assign({ dataTransfer: data }, init));
    document.querySelector(target).dispatchEvent(event);
    return event.defaultPrevented;
"""


def dispatch(driver: Any, target: str, kind: str, *files: tuple[str, str, bytes]) -> bool:
    """Fire a ``kind`` event (paste, dragover, drop) carrying ``files`` (name, type, bytes) at
    ``target``; whether the page took it (prevented the browser's own handling)."""
    return driver.execute_script(DROP, target, kind, [[n, t, base64.b64encode(b).decode()] for n, t, b in files])


# ---------------------------------------------------------------- cases

def test_attach_send_and_reload(live: LiveServer, driver: Any, tmp_path: Path) -> None:
    png, jpeg = picture(tmp_path, "cat.png"), picture(tmp_path, "dog.jpg", seed=1)
    gif = picture(tmp_path, "bird.gif", (20, 20), seed=2)
    open_page(driver, live.url)
    vision_ready(driver)
    assert "Attach images" in css(driver, "#attach")[0].get_attribute("title")
    assert css(driver, "#attach-file")[0].get_attribute("accept") == "image/*"
    assert not css(driver, "#attachments")[0].is_displayed()

    attach(driver, png, jpeg, gif)
    wait(driver, lambda d: len(thumbnails(d)) == 3, "three thumbnails in the composer")
    assert thumbnails(driver) == [data_url(png), data_url(jpeg, "image/jpeg"), data_url(gif, "image/gif")]
    css(driver, "#attachments .thumb-remove")[2].click()  # the bird goes
    wait(driver, lambda d: len(thumbnails(d)) == 2, "the removed thumbnail to go")

    send(driver, "What are these?")
    (msg,) = answer_done(driver)
    assert "I see 2 image(s) here, 2 in all: What are these?" in msg.text
    assert thread_images(driver) == [[data_url(png), data_url(jpeg, "image/jpeg")]]
    assert css(driver, ".msg.user .msg-body")[0].text == "What are these?"
    assert thumbnails(driver) == [] and not css(driver, "#attachments")[0].is_displayed()
    sent = live.app.state.requests[-1]["messages"]
    assert sent == [{"role": "user", "content": [
        {"type": "text", "text": "What are these?"},
        {"type": "image_url", "image_url": {"url": data_url(png)}},
        {"type": "image_url", "image_url": {"url": data_url(jpeg, "image/jpeg")}}]}]
    user, _ = path_messages(conversation(live, "What are these?"))
    assert user["content"] == "What are these?" and user["images"] == [
        {"url": data_url(png)}, {"url": data_url(jpeg, "image/jpeg")}]

    reload(driver)  # kept with the conversation, and sent again with the history
    wait(driver, lambda d: css(d, ".msg.user .msg-images img"), "the images after a reload")
    assert thread_images(driver) == [[data_url(png), data_url(jpeg, "image/jpeg")]]
    send(driver, "And the first one?")
    answer_done(driver, 2)
    sent = live.app.state.requests[-1]["messages"]
    assert [image_parts(m) for m in sent] == [[data_url(png), data_url(jpeg, "image/jpeg")], [], []]
    assert sent[2] == {"role": "user", "content": "And the first one?"}  # text alone stays a string
    assert thread_images(driver) == [[data_url(png), data_url(jpeg, "image/jpeg")], []]

    # an image alone is a message too; a click shows it whole
    attach(driver, gif)
    wait(driver, lambda d: len(thumbnails(d)) == 1, "the thumbnail")
    send(driver, "")
    answer_done(driver, 3)
    assert live.app.state.requests[-1]["messages"][-1] == {
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(gif, "image/gif")}}]}
    image = css(driver, ".msg.user .msg-images img")[-1]
    image.click()
    wait(driver, lambda d: "expanded" in image.get_attribute("class"), "the image to open")


def test_editing_keeps_the_images(live: LiveServer, driver: Any, tmp_path: Path) -> None:
    png, bmp = picture(tmp_path, "a.png"), picture(tmp_path, "b.bmp", seed=3)
    open_page(driver, live.url)
    vision_ready(driver)
    attach(driver, png, bmp)
    wait(driver, lambda d: len(thumbnails(d)) == 2, "two thumbnails")
    send(driver, "first look")
    answer_done(driver)
    css(driver, ".msg.user .edit-button")[0].click()
    wait(driver, lambda d: len(css(d, ".msg.user .edit-thumbs .thumb")) == 2, "the images in the edit")
    css(driver, ".msg.user .edit-thumbs .thumb-remove")[0].click()  # the PNG goes
    wait(driver, lambda d: len(css(d, ".msg.user .edit-thumbs .thumb")) == 1, "one image left in the edit")
    area = css(driver, ".msg.user .edit-input")[0]
    area.clear()
    area.send_keys("second look")
    css(driver, ".msg.user .edit-send")[0].click()
    wait(driver, lambda d: any("second look" in m.text for m in css(d, ".msg.assistant"))
         and css(d, ".msg.assistant .msg-stats"), "the answer to the edit")
    assert image_parts(live.app.state.requests[-1]["messages"][-1]) == [data_url(bmp, "image/bmp")]
    assert thread_images(driver) == [[data_url(bmp, "image/bmp")]]
    css(driver, ".msg.user .branch-prev")[0].click()  # the first version keeps both
    wait(driver, lambda d: css(d, ".msg.user .branch-pos")[0].text == "1/2", "the first branch")
    assert thread_images(driver) == [[data_url(png), data_url(bmp, "image/bmp")]]


def test_paste_and_drop(live: LiveServer, driver: Any, tmp_path: Path) -> None:
    png, webp = picture(tmp_path, "p.png").read_bytes(), picture(tmp_path, "w.webp", seed=4).read_bytes()
    open_page(driver, live.url)
    vision_ready(driver)
    assert dispatch(driver, "#prompt", "paste", ("image.png", "image/png", png))
    wait(driver, lambda d: len(thumbnails(d)) == 1, "the pasted image")
    assert dispatch(driver, "#composer", "dragover", ("w.webp", "image/webp", webp))
    assert "dropping" in css(driver, "#composer")[0].get_attribute("class")
    assert dispatch(driver, "#composer", "drop", ("w.webp", "image/webp", webp), ("notes.txt", "text/plain", b"hi"))
    wait(driver, lambda d: len(thumbnails(d)) == 2, "the dropped image")
    assert "notes.txt is not a PNG, JPEG, WebP, GIF or BMP image" in notice(driver, "notes.txt")
    assert "dropping" not in css(driver, "#composer")[0].get_attribute("class")
    assert thumbnails(driver) == [f"data:image/png;base64,{base64.b64encode(png).decode()}",
                                  f"data:image/webp;base64,{base64.b64encode(webp).decode()}"]
    assert dispatch(driver, "#messages", "drop", ("x.png", "image/png", png))  # beside it: not opened in place
    assert len(thumbnails(driver)) == 2
    send(driver, "pasted and dropped")
    answer_done(driver)
    assert len(image_parts(live.app.state.requests[-1]["messages"][-1])) == 2


def test_images_over_the_limit_are_refused(live: LiveServer, driver: Any, tmp_path: Path) -> None:
    big = tmp_path / "huge.png"
    big.write_bytes(picture(tmp_path, "small.png").read_bytes() + bytes(21 * 1024 * 1024))
    text = tmp_path / "notes.txt"
    text.write_text("not a picture")
    open_page(driver, live.url)
    vision_ready(driver)
    attach(driver, big, text, tmp_path / "small.png")
    message = notice(driver, "huge.png", "notes.txt")
    assert "huge.png is 21.0 MB: an image may be at most 20.0 MB" in message
    assert "notes.txt is not a PNG" in message
    wait(driver, lambda d: len(thumbnails(d)) == 1, "the one image that fits")
    many = [picture(tmp_path, f"m{k}.png", (4, 4), seed=k) for k in range(8)]
    attach(driver, *many)
    assert "a message takes at most 8 images" in notice(driver, "m7.png")
    wait(driver, lambda d: len(thumbnails(d)) == 8, "8 thumbnails")


def test_an_image_the_store_refuses_stays_in_the_composer(live: LiveServer, driver: Any, tmp_path: Path) -> None:
    fake = tmp_path / "fake.png"  # named a PNG, holds a drawing: the store reads the bytes
    fake.write_bytes(b"<svg xmlns='http://www.w3.org/2000/svg'/>")
    open_page(driver, live.url)
    vision_ready(driver)
    attach(driver, fake)
    wait(driver, lambda d: len(thumbnails(d)) == 1, "the thumbnail")
    send(driver, "is this kept?")
    assert "images[0] is not a PNG, JPEG, WebP, GIF or BMP image" in notice(driver, "HTTP 400")
    wait(driver, lambda d: len(thumbnails(d)) == 1, "the image given back to the composer")
    assert css(driver, "#prompt")[0].get_attribute("value") == "is this kept?"
    assert not css(driver, ".msg.user")


def test_a_text_only_model_takes_no_images(live: LiveServer, app_state: Any, driver: Any, tmp_path: Path) -> None:
    for capabilities in ({"chat": True, "vision": False}, None, ["chat"]):
        app_state.capabilities = capabilities
        open_page(driver, live.url)
        wait(driver, lambda d: css(d, "#model-name")[0].text == "fake-vlm", "the model's name")
        button = css(driver, "#attach")[0]
        assert not button.is_enabled() and not css(driver, "#attach-file")[0].is_enabled()
        assert TEXT_ONLY in button.get_attribute("title")
        assert TEXT_ONLY in css(driver, "#attach-wrap")[0].get_attribute("title")
    dispatch(driver, "#prompt", "paste", ("image.png", "image/png", picture(tmp_path, "p.png").read_bytes()))
    assert "fake-vlm takes text only" in notice(driver, TEXT_ONLY)
    assert thumbnails(driver) == []
    app_state.capabilities = ["chat", "vision"]  # a list of names is read too
    open_page(driver, live.url)
    vision_ready(driver)


def test_a_refused_image_shows_in_the_thread(live: LiveServer, app_state: Any, driver: Any, tmp_path: Path) -> None:
    app_state.refusal = "messages[0].content[1]: image payload is not a PNG, JPEG, WebP, GIF or BMP image"
    open_page(driver, live.url)
    vision_ready(driver)
    attach(driver, picture(tmp_path, "odd.png"))
    wait(driver, lambda d: len(thumbnails(d)) == 1, "the thumbnail")
    send(driver, "can you see it?")
    wait(driver, lambda d: css(d, ".msg.assistant .msg-error"), "the error in the thread")
    error = css(driver, ".msg.assistant .msg-error")[0].text
    assert app_state.refusal in error and "HTTP 400" in error
    assert css(driver, ".msg.assistant .msg-status.error")
    answer = path_messages(conversation(live, "can you see it?"))[-1]
    assert answer["meta"]["status"] == "error" and app_state.refusal in answer["meta"]["error"]
    assert len(thread_images(driver)[0]) == 1  # the message and its image stay


def test_the_real_server_with_smolvlm(tiny_smolvlm: Path, tmp_path: Path, driver: Any) -> None:
    from llaisys.models import load_model

    app = real_app(tmp_path / "chat.sqlite3", load_model(str(tiny_smolvlm)))
    log = RequestLog(app)
    server = LiveServer(app, log=log)
    try:
        deadline = time.monotonic() + WAIT
        while server.app.state.service.status != "ready":
            assert time.monotonic() < deadline, "the model service did not start"
            time.sleep(0.05)
        png = picture(tmp_path, "photo.png", (96, 64), seed=5)
        open_page(driver, server.url)
        vision_ready(driver)  # the server lists "vision" among the model's capabilities
        css(driver, "#settings-button")[0].click()
        css(driver, "#set-max_tokens")[0].send_keys("6")  # random weights: a short answer
        css(driver, "#set-temperature")[0].send_keys("0")
        css(driver, "#prompt")[0].click()  # leaving a field saves it
        attach(driver, png)
        wait(driver, lambda d: thumbnails(d) == [data_url(png)], "the thumbnail in the composer")
        send(driver, "What is in this picture?")
        (msg,) = answer_done(driver, timeout=120)
        assert not msg.find_elements("css selector", ".msg-error"), msg.text
        assert thread_images(driver) == [[data_url(png)]]
        assert image_parts(log.bodies[-1]["messages"][-1]) == [data_url(png)]
        answer = path_messages(conversation(server, "What is in this picture?"))[-1]
        assert answer["meta"]["status"] == "done" and 1 <= answer["meta"]["completion_tokens"] <= 6

        reload(driver)
        wait(driver, lambda d: css(d, ".msg.user .msg-images img"), "the image after a reload")
        assert thread_images(driver) == [[data_url(png)]]
        send(driver, "And its colours?")  # the image goes again with the history
        answer_done(driver, 2, timeout=120)
        assert not css(driver, ".msg-error")
        assert [image_parts(m) for m in log.bodies[-1]["messages"]] == [[data_url(png)], [], []]
    finally:
        server.stop()
