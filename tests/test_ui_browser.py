"""The chat page in a real browser: headless Chromium (selenium) against a live uvicorn server.

Most cases run on ``build_app``: the chat UI mounted on a FastAPI app with a fake
``/v1/chat/completions`` that streams a canned Markdown answer word by word (no model needed),
so the checks can name what the answer holds (``You said: ...``, a Python code block). One case
runs the page against the real server (``real_app``: ``llaisys.server.create_app`` over SmolLM2).

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
    return text


class FakeModel:
    """What the fake endpoint saw: request bodies, and streams the client cut short."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.disconnects = threading.Event()


def build_app(db_path: Path, api_key: str | None = None) -> FastAPI:
    """The app the browser talks to: ``ui.mount`` plus a fake streaming chat endpoint."""
    app = FastAPI()
    ui.mount(app, SimpleNamespace(db_path=db_path, api_key=api_key))
    fake = app.state.fake = FakeModel()

    def refused(request: Request) -> JSONResponse | None:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"message": "bad key", "type": "authentication_error"}}, 401)
        return None

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        return refused(request) or {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        if (error := refused(request)) is not None:
            return error
        body = await request.json()
        fake.requests.append(body)
        prompt = body["messages"][-1]["content"]
        pieces = re.findall(r"\s*\S+", canned_answer(prompt))
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
                for piece in pieces:
                    if await request.is_disconnected():
                        return
                    yield chunk({"content": piece})
                    await asyncio.sleep(delay)
                yield chunk({}, "stop")
                usage = {"prompt_tokens": 7, "completion_tokens": len(pieces), "total_tokens": 7 + len(pieces)}
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


class LiveServer:
    """``app`` served by uvicorn in a thread on a free port of 127.0.0.1."""

    def __init__(self, app: FastAPI, api_key: str | None = None) -> None:
        self.app, self.api_key = app, api_key
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + WAIT
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def api(self, path: str) -> Any:
        """GET a JSON document from the live server."""
        req = urllib.request.Request(self.url + path.lstrip("/"))
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
    server = LiveServer(real_app(tmp_path / "chat.sqlite3", smollm2_model))
    try:
        deadline = time.monotonic() + WAIT
        while server.app.state.service.status != "ready":
            assert time.monotonic() < deadline, "the model service did not start"
            time.sleep(0.05)
        open_page(driver, server.url)
        name = server.api("v1/models")["data"][0]["id"]
        wait(driver, lambda d: css(d, "#model-name")[0].text == name, "the model's name")
        css(driver, "#settings-button")[0].click()
        css(driver, "#set-max_tokens")[0].send_keys("12")
        css(driver, "#set-temperature")[0].send_keys("0")
        css(driver, "#prompt")[0].click()
        send(driver, "What is the capital of France?")
        (msg,) = answer_done(driver, timeout=60)
        assert msg.find_element("css selector", ".msg-body").text.strip()
        assert re.search(r"\d+ tokens · [\d.]+ tok/s", msg.find_element("css selector", ".msg-stats").text)
        answer = conversation(server, "What is the capital of France?")["messages"][-1]
        assert answer["content"].strip() and answer["meta"]["status"] == "done"
        assert 1 <= answer["meta"]["completion_tokens"] <= 12 and answer["meta"]["finish_reason"] in ("stop", "length")

        # a long answer, stopped: the engine lets the request go
        css(driver, "#set-max_tokens")[0].clear()
        css(driver, "#set-max_tokens")[0].send_keys("2000")
        css(driver, "#prompt")[0].click()
        send(driver, "Write a very long story about a dragon.")
        wait(driver, lambda d: len(css(d, ".msg.streaming .msg-body")) == 1
             and len(css(d, ".msg.streaming .msg-body")[0].text) > 20, "the long answer to start", timeout=60)
        css(driver, "#stop")[0].click()
        wait(driver, lambda d: css(d, ".msg.assistant .msg-status.stopped"), "the answer to be marked stopped")
        service = server.app.state.service
        deadline = time.monotonic() + WAIT
        while service.engine.call(service.engine.engine.has_unfinished).result(timeout=WAIT):
            assert time.monotonic() < deadline, "the engine still runs the stopped request"
            time.sleep(0.05)
        stopped = conversation(server, "What is the capital of France?")["messages"][-1]
        assert stopped["meta"]["status"] == "stopped" and stopped["content"].strip()
    finally:
        server.stop()
