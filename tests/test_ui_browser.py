"""The chat page in a real browser: headless Chromium (selenium) against a live uvicorn server.

Most cases run on ``build_app``: the chat UI mounted on a FastAPI app with a fake
``/v1/chat/completions`` that streams a canned Markdown answer word by word (no model needed),
so the checks can name what the answer holds (``You said: ...``, a Python code block), first
``reasoning_content`` deltas when the prompt says "think", and a fake model service whose
sampling defaults ``/api/settings`` serves. One case runs the page
against the real server (``real_app``: ``llaisys.server.create_app`` over SmolLM2), recording
the requests it gets.

Needs ``chromium`` and ``chromium-driver`` (Debian: ``apt-get install chromium chromium-driver``);
without them these tests fail, saying so. ``LLAISYS_CHROMIUM`` / ``LLAISYS_CHROMEDRIVER`` point
elsewhere.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sqlite3
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from llaisys.generation.defaults import CHAT_MAX_TOKENS, sampling_defaults  # noqa: E402
from llaisys.server import store as store_module  # noqa: E402
from llaisys.server import ui  # noqa: E402

CHROMIUM = os.environ.get("LLAISYS_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("LLAISYS_CHROMEDRIVER", "/usr/bin/chromedriver")
WAIT = 15.0  # seconds for anything the page does (the machine may be busy)


# ---------------------------------------------------------------- the app under test

def canned_answer(prompt: str) -> str:
    """The fake model's answer: it quotes the prompt (so branches differ) and has a code block."""
    text = (f"You said: {prompt}.\n\nHere is **some code**:\n\n```python\ndef add(a, b):\n"
            f"    return a + b  # the sum\n```\n\nDone.")
    if "long" in prompt:
        text += " More" + " words" * 400
    if "table" in prompt:
        text += "\n\n| " + " | ".join(TABLE_WORDS) + " |\n|" + "---|" * len(TABLE_WORDS) + "\n| " + \
            " | ".join(TABLE_WORDS[::-1]) + " |\n"
    return text


TABLE_WORDS = ("Temperature", "Pressure", "Humidity", "Visibility", "Precipitation", "Conditions")


def canned_reasoning(prompt: str) -> str:
    """The fake model's reasoning (for a prompt with "think"): Markdown, and HTML to show as text."""
    return f"I ponder <b>{prompt}</b>: **first** the words, then\n\n- a list\n- of steps"


class FakeModel:
    """What the fake endpoint saw: request bodies, and streams the client cut short."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.disconnects = threading.Event()


def fake_service(generation_defaults: dict[str, Any] | None = None, max_model_len: int = 8192) -> SimpleNamespace:
    """What ``/api/settings`` reads of the app's model service: a loaded model and its context."""
    return SimpleNamespace(status="ready", model=SimpleNamespace(generation_defaults=generation_defaults or {}),
                           max_model_len=max_model_len)


def page_defaults(generation_defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the page should send when the user sets nothing (as the CLI samples)."""
    return {**sampling_defaults(generation_defaults or {}), "max_tokens": CHAT_MAX_TOKENS}


def build_app(db_path: Path, api_key: str | None = None) -> FastAPI:
    """The app the browser talks to: ``ui.mount`` plus a fake streaming chat endpoint, a fake
    ``/tokenize`` (a token per 4 bytes) and a fake model service (FALLBACK_SAMPLING)."""
    app = FastAPI()
    ui.mount(app, SimpleNamespace(db_path=db_path, api_key=api_key))
    app.state.service = fake_service()
    fake = app.state.fake = FakeModel()

    def refused(request: Request) -> JSONResponse | None:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"message": "bad key", "type": "authentication_error"}}, 401)
        return None

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        return refused(request) or {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        body = await request.json()
        count = sum(len(m["content"].encode()) // 4 + 4 for m in body["messages"])
        return {"count": count, "max_model_len": app.state.service.max_model_len, "tokens": [], "token_strs": None}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        if (error := refused(request)) is not None:
            return error
        body = await request.json()
        fake.requests.append(body)
        prompt = body["messages"][-1]["content"]
        pieces = re.findall(r"\s*\S+", canned_answer(prompt))
        thoughts = re.findall(r"\s*\S+", canned_reasoning(prompt)) if "think" in prompt else []
        delay = 0.03 if "long" in prompt else 0.01

        def chunk(delta: dict, finish: str | None = None, **extra: Any) -> str:
            choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
            data = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": "fake-model", "choices": choices, **extra}
            return f"data: {json.dumps(data)}\n\n"

        async def events() -> Any:
            done = False
            try:
                yield chunk({"role": "assistant", "content": ""})
                for piece in thoughts:  # slow enough to see the page think
                    if await request.is_disconnected():
                        return
                    yield chunk({"reasoning_content": piece})
                    await asyncio.sleep(0.06)
                for piece in pieces:
                    if await request.is_disconnected():
                        return
                    yield chunk({"content": piece})
                    await asyncio.sleep(delay)
                yield chunk({}, "length" if "cut" in prompt else "stop")
                n = len(thoughts) + len(pieces)
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                yield f"data: {json.dumps({'id': 'chatcmpl-fake', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
                done = True
            finally:
                if not done:
                    fake.disconnects.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def real_app(db_path: Path, model: Any, api_key: str | None = None) -> FastAPI:
    """The real server (``llaisys serve``) over ``model``, its conversations in ``db_path``."""
    from llaisys.server import ServerOptions, create_app

    return create_app(ServerOptions(db_path=str(db_path), api_key=api_key), model=model)


class RequestLog:
    """ASGI middleware around ``app``: keeps the JSON bodies POSTed to ``path`` in ``bodies``."""

    def __init__(self, app: Any, path: str = "/v1/chat/completions") -> None:
        self.app, self.path = app, path
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        self.bodies.append(json.loads(b"".join(chunks)))
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect the app waits for
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


class LiveServer:
    """``app`` served by uvicorn in a thread on a free port of 127.0.0.1 (through ``log`` when
    given: a RequestLog around ``app``)."""

    def __init__(self, app: FastAPI, api_key: str | None = None, log: RequestLog | None = None) -> None:
        self.app, self.api_key = app, api_key
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        self.server = uvicorn.Server(uvicorn.Config(log or app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + WAIT
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def api(self, path: str, method: str = "GET", body: Any = None) -> Any:
        """A JSON document from the live server (``body``: sent as JSON)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path.lstrip("/"), data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=WAIT) as res:
            return json.loads(res.read())

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer(build_app(tmp_path_factory.mktemp("ui") / "chat.sqlite3"))
    yield server
    server.stop()


# ---------------------------------------------------------------- the browser

def new_driver() -> Any:
    """A headless Chromium; fails (not skips) when it is not installed."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is missing: pip install selenium (it is in the test extra)")
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        pytest.fail(f"the browser tests need Chromium and its driver; missing {', '.join(missing)}. "
                    f"Install them with: apt-get install chromium chromium-driver "
                    f"(or set LLAISYS_CHROMIUM / LLAISYS_CHROMEDRIVER)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--disable-extensions"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    d = new_driver()
    yield d
    d.quit()


def wait(driver: Any, predicate: Any, what: str, timeout: float = WAIT) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # the page re-renders messages as they change: an element found a moment ago may be gone
    return WebDriverWait(driver, timeout, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)
                         ).until(predicate, message=f"waiting for {what}")


def css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def open_page(driver: Any, url: str) -> None:
    driver.get(url)
    wait(driver, lambda d: d.execute_script("return document.body.dataset.ready === '1'"), "the page to load")


def reload(driver: Any) -> None:
    """Reload the page as F5 does (chromedriver's refresh() reloads the URL it last navigated to,
    losing the chat's ``#c=<id>`` that the page set since)."""
    driver.execute_script("window.beforeReload = true; location.reload();")
    wait(driver, lambda d: d.execute_script("return !window.beforeReload && document.body.dataset.ready === '1'"),
         "the page to reload")


def open_conversation(driver: Any, url: str, cid: str) -> None:
    """Load the page with the conversation ``cid`` open (as after a reload on it)."""
    open_page(driver, url)
    driver.execute_script("location.hash = arguments[0]", f"c={cid}")  # no reload by itself
    reload(driver)


def send(driver: Any, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    css(driver, "#prompt")[0].send_keys(text + Keys.ENTER)


def answer_done(driver: Any, count: int = 1, timeout: float = WAIT) -> list[Any]:
    """Wait for ``count`` finished assistant answers (their stats line shows) and return them."""
    wait(driver, lambda d: len(css(d, ".msg.assistant .msg-stats")) >= count and not css(d, ".msg.streaming"),
         f"{count} finished answer(s)", timeout)
    return css(driver, ".msg.assistant")


def conversation(live: LiveServer, title: str) -> dict[str, Any]:
    """The stored conversation titled ``title`` (exactly one)."""
    found = [c for c in live.api("api/conversations")["data"] if c["title"] == title]
    assert len(found) == 1, f"conversations titled {title!r}: {found}"
    return live.api(f"api/conversations/{found[0]['id']}")


# ---------------------------------------------------------------- cases

def test_answer_streams_as_markdown_with_code(live: LiveServer, driver: Any) -> None:
    open_page(driver, live.url)
    send(driver, "show me code")
    (msg,) = answer_done(driver)
    code = msg.find_elements("css selector", ".code-block pre code")
    assert len(code) == 1 and "def add(a, b):" in code[0].text
    assert msg.find_elements("css selector", "pre code .tok-keyword"), "the code is not highlighted"
    assert msg.find_elements("css selector", "strong")[0].text == "some code"
    stats = msg.find_element("css selector", ".msg-stats").text
    assert re.search(r"\d+ tokens · [\d.]+ tok/s", stats), stats
    copy = msg.find_element("css selector", ".copy-code")
    copy.click()
    wait(driver, lambda d: copy.text == "Copied", "the copy button to say Copied")

    sent = live.app.state.fake.requests[-1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["model"] == "fake-model" and sent["messages"] == [{"role": "user", "content": "show me code"}]
    stored = conversation(live, "show me code")
    user, answer = (next(m for m in stored["messages"] if m["id"] == i) for i in stored["path"])
    assert user["content"] == "show me code" and answer["content"] == canned_answer("show me code")
    assert answer["meta"]["status"] == "done" and answer["meta"]["completion_tokens"] > 10
    assert answer["meta"]["tokens_per_s"] > 0
    assert "reasoning" not in answer["meta"] and not msg.find_elements("css selector", ".reasoning")


def test_stop_keeps_the_partial_answer(live: LiveServer, driver: Any) -> None:
    open_page(driver, live.url)
    live.app.state.fake.disconnects.clear()
    send(driver, "a long answer please")
    wait(driver, lambda d: len(css(d, ".msg.streaming .msg-body")) == 1
         and "words words" in css(d, ".msg.streaming .msg-body")[0].text, "the answer to start")
    time.sleep(1.3)  # long enough for a save while streaming
    stored = conversation(live, "a long answer please")
    partial = stored["messages"][-1]
    assert partial["meta"]["status"] == "streaming" and partial["content"].startswith("You said:"), \
        "the answer is not saved while it streams"

    css(driver, "#stop")[0].click()
    wait(driver, lambda d: css(d, ".msg.assistant .msg-status.stopped"), "the answer to be marked stopped")
    shown = css(driver, ".msg.assistant .msg-body")[0].text
    assert "words" in shown
    assert live.app.state.fake.disconnects.wait(5), "the server did not see the client go"
    answer = conversation(live, "a long answer please")["messages"][-1]
    assert answer["meta"]["status"] == "stopped"
    assert len(partial["content"]) <= len(answer["content"]) < len(canned_answer("a long answer please"))
    assert css(driver, "#send")[0].is_displayed() and not css(driver, "#stop")[0].is_displayed()


def test_an_answer_cut_at_max_tokens_is_marked(live: LiveServer, driver: Any) -> None:
    open_page(driver, live.url)
    send(driver, "an answer cut short")
    (msg,) = answer_done(driver)
    mark = msg.find_elements("css selector", ".msg-status.length")
    assert len(mark) == 1 and "max tokens" in mark[0].text
    assert conversation(live, "an answer cut short")["messages"][-1]["meta"]["finish_reason"] == "length"
    reload(driver)  # the mark comes from what was stored
    wait(driver, lambda d: len(css(d, ".msg.assistant .msg-status.length")) == 1, "the mark after a reload")
    send(driver, "then a whole answer")
    answers = answer_done(driver, 2)
    assert not answers[1].find_elements("css selector", ".msg-status")


NARROW = (420, 800)  # a phone's width


def test_a_narrow_window_keeps_every_button_and_whole_words(live: LiveServer, driver: Any) -> None:
    size = driver.get_window_size()
    driver.set_window_size(*NARROW)
    try:
        open_page(driver, live.url)
        send(driver, "a table please")
        (msg,) = answer_done(driver)
        width = driver.execute_script("return document.documentElement.clientWidth")
        for name in ("rename-button", "settings-button", "export-button", "toggle-sidebar"):
            button = css(driver, "#" + name)[0]
            rect = driver.execute_script("return arguments[0].getBoundingClientRect().toJSON()", button)
            assert button.is_displayed() and rect["left"] >= 0 and rect["right"] <= width, (name, rect, width)
        # each cell holds one word: one line box for its text, not a word broken over lines
        lines = driver.execute_script("""
            return Array.from(arguments[0].querySelectorAll('td, th')).map(cell => {
              const range = document.createRange(); range.selectNodeContents(cell);
              return [cell.textContent, range.getClientRects().length];
            });""", msg)
        assert sorted(text for text, _ in lines) == sorted(TABLE_WORDS * 2)
        assert all(n == 1 for _, n in lines), f"table cells broken over lines: {lines}"
        css(driver, "#rename-button")[0].click()
        wait(driver, lambda d: css(d, ".rename-input") and css(d, ".rename-input")[0].is_displayed()
             and d.execute_script("return arguments[0].getBoundingClientRect().left >= 0", css(d, ".rename-input")[0]),
             "the rename field, on screen")
    finally:
        driver.set_window_size(size["width"], size["height"])


def path_messages(stored: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages on the conversation's active path, first to last."""
    by_id = {m["id"]: m for m in stored["messages"]}
    return [by_id[i] for i in stored["path"]]


def test_reload_during_a_stream_keeps_the_answer_stopped(live: LiveServer, driver: Any) -> None:
    open_page(driver, live.url)
    send(driver, "a long answer, then a reload")
    wait(driver, lambda d: len(css(d, ".msg.streaming .msg-body")) == 1
         and "words words" in css(d, ".msg.streaming .msg-body")[0].text, "the answer to start")
    reload(driver)
    wait(driver, lambda d: css(d, ".msg.assistant .msg-status"), "the cut answer after the reload")
    time.sleep(1.0)  # anything the old page sent on its way out lands
    user, answer = path_messages(conversation(live, "a long answer, then a reload"))
    assert user["content"] == "a long answer, then a reload"
    assert answer["meta"]["status"] == "stopped" and "error" not in answer["meta"], answer["meta"]
    full = canned_answer("a long answer, then a reload")
    assert answer["content"].startswith("You said:") and "words" in answer["content"]
    assert len(answer["content"]) < len(full)
    assert css(driver, ".msg.assistant .msg-status")[0].text == "stopped" and not css(driver, ".msg-error")
    assert "words" in css(driver, ".msg.assistant .msg-body")[0].text
    send(driver, "and after it?")  # the page goes on
    answer_done(driver, 2)
    assert path_messages(conversation(live, "a long answer, then a reload"))[-1]["meta"]["status"] == "done"


def test_reload_marks_this_tabs_unsaved_stream_stopped(live: LiveServer, driver: Any) -> None:
    # the save on the way out may not land (a dead network, a text past keepalive's 64 KiB): the
    # next load of the tab marks the answer it was streaming, and no other tab's
    cid = live.api("api/conversations", "POST", {"title": "cut twice"})["id"]
    ids = []
    for text in ("mine", "another tab's"):
        q = live.api(f"api/conversations/{cid}/messages", "POST", {"role": "user", "content": text})
        a = live.api(f"api/conversations/{cid}/messages", "POST", {
            "role": "assistant", "content": f"{text} partial", "parent_id": q["id"], "meta": {"status": "streaming"}})
        ids.append(a["id"])
    open_page(driver, live.url)
    driver.execute_script("sessionStorage.setItem('llaisys.streaming', JSON.stringify(arguments[0]))",
                          {"conv": cid, "msg": ids[0]})
    open_conversation(driver, live.url, cid)
    wait(driver, lambda d: css(d, ".msg.assistant .msg-status"), "the conversation")
    by_id = {m["id"]: m for m in live.api(f"api/conversations/{cid}")["messages"]}
    assert by_id[ids[0]]["meta"] == {"status": "stopped"} and by_id[ids[0]]["content"] == "mine partial"
    assert by_id[ids[1]]["meta"] == {"status": "streaming"}  # maybe still running elsewhere
    assert css(driver, ".msg.assistant .msg-status")[0].text == "interrupted"  # the path shows the last one
    assert driver.execute_script("return sessionStorage.getItem('llaisys.streaming')") is None


def test_page_sends_the_models_defaults(live: LiveServer, driver: Any) -> None:
    expected = page_defaults()
    open_page(driver, live.url)
    css(driver, "#settings-button")[0].click()
    wait(driver, lambda d: css(d, "#set-max_tokens")[0].get_attribute("placeholder") == str(CHAT_MAX_TOKENS),
         "the defaults in the settings panel")
    for key in ("temperature", "top_p"):
        field = css(driver, f"#set-{key}")[0]
        assert float(field.get_attribute("placeholder")) == expected[key] and field.get_attribute("value") == ""
    assert f"max tokens {CHAT_MAX_TOKENS}" in css(driver, "#settings-defaults")[0].text
    send(driver, "use the defaults")
    answer_done(driver)
    sent = live.app.state.fake.requests[-1]
    assert {k: sent.get(k) for k in expected} == expected and "seed" not in sent
    answer = path_messages(conversation(live, "use the defaults"))[-1]
    assert answer["meta"]["sampling"] == expected

    css(driver, "#set-temperature")[0].send_keys("1.2")  # the user's own value wins, for its key only
    css(driver, "#prompt")[0].click()
    send(driver, "now hotter")
    answer_done(driver, 2)
    sent = live.app.state.fake.requests[-1]
    assert sent["temperature"] == 1.2 and sent["top_p"] == expected["top_p"] and sent["max_tokens"] == CHAT_MAX_TOKENS

    # a model whose generation_config.json says how to sample: its values (all of them)
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    live.app.state.service = fake_service(config)
    try:
        open_page(driver, live.url)
        send(driver, "the model's own")
        answer_done(driver)
        sent = live.app.state.fake.requests[-1]
        expected = page_defaults(config)
        assert {k: sent.get(k) for k in expected} == expected and sent["top_k"] == 20
    finally:
        live.app.state.service = fake_service()


def test_default_max_tokens_fits_the_context(live: LiveServer, driver: Any) -> None:
    # the server refuses a prompt plus max_tokens over the context: the default shrinks to fit
    live.app.state.service = fake_service(max_model_len=CHAT_MAX_TOKENS + 300)
    try:
        open_page(driver, live.url)
        send(driver, "short")
        answer_done(driver)
        assert live.app.state.fake.requests[-1]["max_tokens"] == CHAT_MAX_TOKENS
        prompt = "x" * 1600
        driver.execute_script("document.getElementById('prompt').value = arguments[0]", prompt)
        send(driver, "")
        answer_done(driver, 2)
        sent = live.app.state.fake.requests[-1]
        count = sum(len(m["content"].encode()) // 4 + 4 for m in sent["messages"])  # the fake /tokenize's count
        assert sent["max_tokens"] == CHAT_MAX_TOKENS + 300 - count < CHAT_MAX_TOKENS
    finally:
        live.app.state.service = fake_service()


def test_wrong_types_in_meta_do_not_hide_the_answer(live: LiveServer, driver: Any, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cid = live.api("api/conversations", "POST", {"title": "odd meta"})["id"]
    parent, answers = None, []
    for k in range(3):
        q = live.api(f"api/conversations/{cid}/messages", "POST",
                     {"role": "user", "content": f"question {k}", "parent_id": parent})
        a = live.api(f"api/conversations/{cid}/messages", "POST", {"role": "assistant", "parent_id": q["id"],
                                                                   "content": f"**answer {k}** is here"})
        parent = a["id"]
        answers.append(a["id"])
    bad = [{"status": 5, "tokens_per_s": "fast", "ttft_s": {"s": 1}, "completion_tokens": "many", "error": ["x"]},
           [1, 2], {"status": "done", "tokens_per_s": "fast", "completion_tokens": 3}]
    with sqlite3.connect(live.app.state.conversation_store.path) as db:  # what an older server let in
        for mid, meta in zip(answers, bad):
            db.execute("UPDATE messages SET meta = ? WHERE id = ?", (json.dumps(meta), mid))
    monkeypatch.setattr(store_module, "clean_meta", lambda meta: meta)  # hand it to the page as stored
    open_conversation(driver, live.url, cid)
    wait(driver, lambda d: len(css(d, ".msg.assistant")) == 3, "the three answers")
    bodies = [b.text for b in css(driver, ".msg.assistant .msg-body")]
    assert bodies == [f"answer {k} is here" for k in range(3)]
    assert css(driver, ".msg.assistant strong")[0].text == "answer 0"  # rendered as Markdown, not plain text
    assert css(driver, ".msg.assistant .msg-stats")[-1].text == "3 tokens"
    assert not css(driver, ".msg-error") and not css(driver, ".msg-status")
    monkeypatch.undo()

    # such a file is refused on import, saying why
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"conversation": {"title": "odd import", "messages": [
        {"id": "q", "role": "user", "content": "hi"},
        {"id": "a", "parent_id": "q", "role": "assistant", "content": "hello", "meta": {"tokens_per_s": "fast"}}]}}))
    field = css(driver, "#import-file")[0]
    driver.execute_script("arguments[0].hidden = false", field)
    field.send_keys(str(path))
    wait(driver, lambda d: "tokens_per_s must be a number" in css(d, "#notice")[0].text, "the import's error")
    assert not [c for c in live.api("api/conversations")["data"] if c["title"] == "odd import"]


def test_reasoning_is_folded_kept_and_not_sent_back(live: LiveServer, driver: Any) -> None:
    prompt = "think first"
    open_page(driver, live.url)
    send(driver, prompt)
    wait(driver, lambda d: [f for f in css(d, ".msg.streaming details.reasoning.thinking")
                            if f.find_element("css selector", "summary").text == "Thinking…"],
         "the folded reasoning while the model thinks")
    (msg,) = answer_done(driver)
    fold = msg.find_element("css selector", "details.reasoning")
    assert fold.get_attribute("open") is None and "thinking" not in fold.get_attribute("class")
    assert fold.find_element("css selector", "summary").text == "Reasoning"
    body = fold.find_element("css selector", ".reasoning-body")
    assert not body.is_displayed()  # folded: shown only on a click
    assert "I ponder <b>think first</b>" in body.get_attribute("textContent")  # HTML shows as text
    assert not body.find_elements("css selector", "b") and body.find_element("css selector", "strong").get_attribute(
        "textContent") == "first"
    answer = msg.find_element("css selector", ".msg-body").text
    assert answer.startswith("You said: think first.") and "ponder" not in answer
    fold.find_element("css selector", "summary").click()
    wait(driver, lambda d: body.is_displayed(), "the reasoning to unfold")
    assert body.text.startswith("I ponder <b>think first</b>: first the words, then")

    stored = path_messages(conversation(live, prompt))[-1]
    assert stored["content"] == canned_answer(prompt) and stored["meta"]["reasoning"] == canned_reasoning(prompt)
    assert stored["meta"]["status"] == "done"

    reload(driver)  # kept: still folded after a reload
    wait(driver, lambda d: css(d, ".msg.assistant details.reasoning"), "the reasoning after a reload")
    fold = css(driver, ".msg.assistant details.reasoning")[0]
    assert fold.get_attribute("open") is None
    assert "I ponder <b>think first</b>" in fold.find_element("css selector", ".reasoning-body").get_attribute(
        "textContent")

    # the next request carries the answer's content only, as OpenAI clients send it
    send(driver, "and then, think again?")
    fold = wait(driver, lambda d: css(d, ".msg.streaming details.reasoning"), "the second reasoning")[0]
    fold.find_element("css selector", "summary").click()  # opened while it streams: stays open after
    answer_done(driver, 2)
    sent = live.app.state.fake.requests[-1]
    assert sent["messages"] == [{"role": "user", "content": prompt},
                                {"role": "assistant", "content": canned_answer(prompt)},
                                {"role": "user", "content": "and then, think again?"}]
    assert "ponder" not in json.dumps(sent)
    folds = css(driver, ".msg.assistant details.reasoning")
    assert [f.get_attribute("open") for f in folds] == [None, "true"]

    # an export imported again keeps the reasoning
    cid = conversation(live, prompt)["id"]
    made = live.api("api/conversations/import", "POST", live.api(f"api/conversations/{cid}/export"))["data"][0]
    open_conversation(driver, live.url, made["id"])
    wait(driver, lambda d: len(css(d, ".msg.assistant details.reasoning")) == 2, "the imported reasoning")
    assert "and then, think again?" in css(driver, ".msg.assistant details.reasoning .reasoning-body")[1].get_attribute(
        "textContent")


def test_reload_while_thinking_keeps_the_reasoning(live: LiveServer, driver: Any) -> None:
    prompt = "think, then a reload"
    open_page(driver, live.url)
    send(driver, prompt)
    wait(driver, lambda d: "ponder" in d.execute_script(
        "const b = document.querySelector('.msg.streaming .reasoning-body'); return b ? b.textContent : ''"),
         "the reasoning to start")
    reload(driver)  # the save on the way out carries the reasoning so far
    wait(driver, lambda d: css(d, ".msg.assistant .msg-status"), "the cut answer after the reload")
    time.sleep(1.0)  # anything the old page sent on its way out lands
    answer = path_messages(conversation(live, prompt))[-1]
    assert answer["meta"]["status"] == "stopped" and answer["content"] == ""
    assert canned_reasoning(prompt).startswith(answer["meta"]["reasoning"]) and "ponder" in answer["meta"]["reasoning"]
    fold = css(driver, ".msg.assistant details.reasoning")[0]
    assert fold.find_element("css selector", "summary").text == "Reasoning"  # no longer thinking


def test_edit_makes_a_branch_and_both_stay(live: LiveServer, driver: Any) -> None:
    open_page(driver, live.url)
    send(driver, "first question")
    answer_done(driver)
    css(driver, ".msg.user .edit-button")[0].click()
    area = css(driver, ".msg.user .edit-input")[0]
    area.clear()
    area.send_keys("second question")
    css(driver, ".msg.user .edit-send")[0].click()
    wait(driver, lambda d: "You said: second question." in d.find_element("css selector", ".msg.assistant").text
         and css(d, ".msg.assistant .msg-stats"), "the answer to the edited question")
    assert css(driver, ".msg.user .branch-pos")[0].text == "2/2"

    css(driver, ".msg.user .branch-prev")[0].click()
    wait(driver, lambda d: css(d, ".msg.user .branch-pos")[0].text == "1/2", "the switch to the first branch")
    assert css(driver, ".msg.user .msg-body")[0].text == "first question"
    assert "You said: first question." in css(driver, ".msg.assistant .msg-body")[0].text
    time.sleep(0.3)  # the switch is saved in the background
    stored = conversation(live, "first question")
    assert len(stored["messages"]) == 4
    assert [m["content"] for m in stored["messages"] if m["id"] == stored["path"][0]] == ["first question"]

    reload(driver)  # the branch on screen is kept
    wait(driver, lambda d: css(d, ".msg.user .branch-pos"), "the conversation after a reload")
    assert css(driver, ".msg.user .branch-pos")[0].text == "1/2"


def test_reload_and_a_second_browser_see_the_conversation(live: LiveServer, driver: Any) -> None:
    open_page(driver, live.url)
    css(driver, "#settings-button")[0].click()
    css(driver, "#system-prompt")[0].send_keys("Be brief.")
    css(driver, "#set-temperature")[0].send_keys("0.5")
    css(driver, "#set-seed")[0].send_keys("42")
    css(driver, "#prompt")[0].click()  # leaving a field saves it
    send(driver, "remember me")
    answer_done(driver)
    sent = live.app.state.fake.requests[-1]
    assert sent["messages"][0] == {"role": "system", "content": "Be brief."}
    assert sent["temperature"] == 0.5 and sent["seed"] == 42
    assert conversation(live, "remember me")["settings"] == {"temperature": 0.5, "seed": 42}

    reload(driver)
    wait(driver, lambda d: css(d, ".msg.assistant .msg-stats"), "the conversation after a reload")
    assert css(driver, ".msg.user .msg-body")[0].text == "remember me"
    assert css(driver, "#chat-title")[0].text == "remember me"

    other = new_driver()
    try:
        open_page(other, live.url)
        item = wait(other, lambda d: [li for li in css(d, ".conversation") if "remember me" in li.text],
                    "the conversation in the second browser's list")[0]
        item.find_element("css selector", ".conv-open").click()
        wait(other, lambda d: css(d, ".msg.assistant .code-block"), "the answer in the second browser")
        assert css(other, ".msg.user .msg-body")[0].text == "remember me"
        assert "You said: remember me." in css(other, ".msg.assistant .msg-body")[0].text
        css(other, "#search")[0].send_keys("zzz-no-such-chat")
        wait(other, lambda d: css(d, "#conversation-list .empty"), "an empty search result")
    finally:
        other.quit()


def test_markdown_renderer_escapes_html(live: LiveServer, driver: Any) -> None:
    open_page(driver, live.url)
    render = "return window.LlaisysMarkdown.render(arguments[0]);"
    hostile = ("<script>alert(1)</script> <img src=x onerror=alert(1)> [x](javascript:alert(1)) "
               '[y](https://e.org/" onclick="alert(1)) `<b>`\n\n```html\n<script>x</script>\n```\n\n'
               "| <i>a</i> |\n|---|\n| <u>b</u> |")
    html = driver.execute_script(render, hostile)
    assert "<script" not in html and "<img" not in html and "<i>" not in html and "<u>" not in html
    assert "javascript:" not in html.split("href=")[-1] and 'onclick="' not in html
    assert "&lt;script&gt;" in html and "<code>&lt;b&gt;</code>" in html
    nested = driver.execute_script(render, "- a\n  1. b\n\n> **c** and *d* ~~e~~")
    assert nested == ("<ul><li><p>a</p><ol><li><p>b</p></li></ol></li></ul>"
                      "<blockquote><p><strong>c</strong> and <em>d</em> <del>e</del></p></blockquote>")


def test_api_key_is_asked_once(tmp_path: Path, driver: Any) -> None:
    server = LiveServer(build_app(tmp_path / "chat.sqlite3", api_key="sesame"), api_key="sesame")
    try:
        driver.get(server.url)
        wait(driver, lambda d: d.execute_script("return document.getElementById('key-dialog').open"),
             "the API key dialog")
        css(driver, "#key-input")[0].send_keys("sesame\n")
        wait(driver, lambda d: d.execute_script("return document.body.dataset.ready === '1'"), "the page")
        send(driver, "with a key")
        answer_done(driver)
        assert conversation(server, "with a key")["messages"][-1]["meta"]["status"] == "done"
        open_page(driver, server.url)  # a reload remembers the key
        assert not driver.execute_script("return document.getElementById('key-dialog').open")
    finally:
        driver.execute_script("localStorage.clear()")
        server.stop()


def test_the_real_server(smollm2_model: Any, tmp_path: Path, driver: Any) -> None:
    app = real_app(tmp_path / "chat.sqlite3", smollm2_model)
    log = RequestLog(app)
    server = LiveServer(app, log=log)
    try:
        deadline = time.monotonic() + WAIT
        while server.app.state.service.status != "ready":
            assert time.monotonic() < deadline, "the model service did not start"
            time.sleep(0.05)
        open_page(driver, server.url)
        name = server.api("v1/models")["data"][0]["id"]
        wait(driver, lambda d: css(d, "#model-name")[0].text == name, "the model's name")

        # nothing set: the model's defaults, shown and sent, so a long answer stops at max_tokens
        expected = page_defaults(smollm2_model.generation_defaults)
        assert server.api("api/settings") == {"temperature": None, "top_p": None, **expected,
                                              "max_model_len": server.app.state.service.max_model_len}
        css(driver, "#settings-button")[0].click()
        wait(driver, lambda d: css(d, "#set-max_tokens")[0].get_attribute("placeholder") == str(CHAT_MAX_TOKENS),
             "the defaults in the settings panel")
        assert float(css(driver, "#set-temperature")[0].get_attribute("placeholder")) == expected["temperature"]
        send(driver, "Write a very long story about a dragon.")
        wait(driver, lambda d: len(css(d, ".msg.streaming .msg-body")) == 1
             and len(css(d, ".msg.streaming .msg-body")[0].text) > 20, "the long answer to start", timeout=60)
        sent = log.bodies[-1]
        assert {k: sent.get(k) for k in expected} == expected and sent["stream"] is True
        # stopped: the engine lets the request go
        css(driver, "#stop")[0].click()
        wait(driver, lambda d: css(d, ".msg.assistant .msg-status.stopped"), "the answer to be marked stopped")
        service = server.app.state.service
        deadline = time.monotonic() + WAIT
        while service.engine.call(service.engine.engine.has_unfinished).result(timeout=WAIT):
            assert time.monotonic() < deadline, "the engine still runs the stopped request"
            time.sleep(0.05)
        stopped = conversation(server, "Write a very long story about a dragon.")["messages"][-1]
        assert stopped["meta"]["status"] == "stopped" and stopped["content"].strip()
        assert stopped["meta"]["sampling"] == expected

        # the chat's own settings win
        css(driver, "#new-chat")[0].click()
        css(driver, "#set-max_tokens")[0].send_keys("12")
        css(driver, "#set-temperature")[0].send_keys("0")
        css(driver, "#prompt")[0].click()
        send(driver, "What is the capital of France?")
        (msg,) = answer_done(driver, timeout=60)
        sent = log.bodies[-1]
        assert sent["max_tokens"] == 12 and sent["temperature"] == 0 and sent.get("top_p") == expected.get("top_p")
        assert msg.find_element("css selector", ".msg-body").text.strip()
        assert re.search(r"\d+ tokens · [\d.]+ tok/s", msg.find_element("css selector", ".msg-stats").text)
        answer = conversation(server, "What is the capital of France?")["messages"][-1]
        assert answer["content"].strip() and answer["meta"]["status"] == "done"
        assert 1 <= answer["meta"]["completion_tokens"] <= 12 and answer["meta"]["finish_reason"] in ("stop", "length")
    finally:
        server.stop()


def test_the_model_picker_of_a_server_of_several(smollm2_path: Path, tmp_path: Path, driver: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from llaisys.server import ServerOptions, create_app

    monkeypatch.setattr("llaisys.server.fleet.listed_models", dict)  # only the two named here
    options = ServerOptions(db_path=str(tmp_path / "chat.sqlite3"), kv_cache_tokens=512,
                            models=(("first", str(smollm2_path)), ("second", str(smollm2_path))))
    log = RequestLog(create_app(options))
    server = LiveServer(log.app, log=log)
    try:
        open_page(driver, server.url)
        wait(driver, lambda d: not css(d, "#model-picker")[0].get_attribute("hidden"), "the model picker")
        options_shown = [o.text for o in css(driver, "#model-picker option")]
        assert options_shown == ["first (unloaded)", "second (unloaded)"] and not css(driver, "#model-name")[0].is_displayed()
        from selenium.webdriver.support.ui import Select

        Select(css(driver, "#model-picker")[0]).select_by_value("second")  # loads it for its defaults
        wait(driver, lambda d: [o.text for o in css(d, "#model-picker option")] == ["first (unloaded)", "second"],
             "the chosen model loaded", timeout=60)
        css(driver, "#new-chat")[0].click()
        css(driver, "#settings-button")[0].click()
        css(driver, "#set-max_tokens")[0].send_keys("4")
        css(driver, "#prompt")[0].click()
        send(driver, "Hello there")
        answer_done(driver, timeout=60)
        assert log.bodies[-1]["model"] == "second"
        answer = conversation(server, "Hello there")["messages"][-1]
        assert answer["meta"]["model"] == "second" and answer["meta"]["status"] == "done"
        states = {m["id"]: m["status"]["value"] for m in server.api("v1/models")["data"]}
        assert states == {"first": "unloaded", "second": "loaded"}
        reload(driver)  # the choice is kept
        wait(driver, lambda d: Select(css(d, "#model-picker")[0]).first_selected_option.get_attribute("value")
             == "second", "the kept choice")
    finally:
        driver.execute_script("localStorage.clear()")
        server.stop()
