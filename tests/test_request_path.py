"""One chat completion's way through the live server, traced call by call.

A profile hook (``threading.setprofile`` for the server's threads, ``sys.setprofile`` for this
one) keeps, per thread, the stack of llaisys files entered. While one non-streaming request
runs through the official ``openai`` client, it checks that no file is entered again above
another llaisys file (the middlewares, the route, the protocol module, the builder, the
service, the engine thread each entered once), and notes the request's main path: the
handler's stack when it submits to ``EngineThread``, the builder's (``server/requests.py``) at
its deepest, and the engine thread's when it enters the kernels.

The ASGI ``receive`` and ``send`` the middlewares hand down (the body replayed, the answer
watched) are called back from below by design; what such a callback runs is checked as a
stack of its own.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
from test_server import client_for, running

import llaisys
from llaisys.engine.thread import EngineThread
from llaisys.server import ServerOptions, create_app
from llaisys.server.middleware import AnthropicErrors, BodyGuard

pytestmark = pytest.mark.timeout(120)

PACKAGE = Path(llaisys.__file__).resolve().parent
ROOT = str(PACKAGE) + "/"
SERVER = str(PACKAGE / "server") + "/"
BUILDER = str(PACKAGE / "server" / "requests.py")
KERNELS = str(PACKAGE / "kernels" / "cpu" / "native_calls.py")
SUBMIT = EngineThread.submit_async.__code__
MAX_SERVER_FILES = 6  # on the main path: middleware, route, protocol module, builder, service (and one spare)
MAX_HANDLER_TO_KERNEL = 10  # files from the route handler to the kernel (the middlewares before it aside)
BESIDE = {"server/middleware.py",  # wraps the handler, before it
          "models/chat_template.py", "models/template_sandbox.py"}  # the builder renders the messages with them
# Files outside the server that a request's step enters again (models/passes.py around
# models/layers.py; the CPU kernels' lookup, kernels/cpu/native_calls.py around
# native_ops.py, quantized.py and paged_native.py; native_ops.py around tensor/tensor.py).
# Not the server's to change: reported, and any other file is held to the rule.
KNOWN_REENTERED = {"models/passes.py", "kernels/cpu/native_calls.py", "kernels/cpu/native_ops.py"}


def nested(fn: Callable[..., Any], name: str) -> CodeType:
    """The code of the function ``name`` defined inside ``fn``."""
    return next(c for c in fn.__code__.co_consts if isinstance(c, CodeType) and c.co_name == name)


CALLBACKS = {nested(BodyGuard.__call__, "replay"), nested(BodyGuard._run, "tracked"),
             nested(AnthropicErrors.__call__, "reshaping")}


def short(path: str) -> str:
    return Path(path).relative_to(PACKAGE).as_posix()


def collapsed(stack: list[tuple[str, FrameType]]) -> list[str]:
    """The files of ``stack``, bottom first, from its last ASGI callback on, consecutive frames
    of one file once."""
    files: list[str] = []
    for path, frame in stack:
        if frame.f_code in CALLBACKS:
            files = []
        if not files or files[-1] != path:
            files.append(path)
    return files


class Tracer:
    """The profile hook: each thread's stack of llaisys frames, and, while ``recording``, what
    the test asserts on."""

    def __init__(self) -> None:
        self.stacks: dict[int, list[tuple[str, FrameType]]] = {}
        self.recording = False
        self.reentries: dict[tuple[str, ...], str] = {}  # files, bottom first, up to one entered again -> thread
        self.at_submit: list[str] = []  # the handler's files when it calls EngineThread.submit_async
        self.builder: tuple[int, int, list[str]] = (0, 0, [])  # the deepest stack through requests.py
        self.at_kernels: list[str] = []  # the engine thread's, entering the kernels (the most files)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" and event != "return":
            return
        path = frame.f_code.co_filename
        if not path.startswith(ROOT):
            return
        stack = self.stacks.setdefault(threading.get_ident(), [])
        if event == "call":  # a coroutine or generator resumed is entered again too
            stack.append((path, frame))
            if self.recording:
                self._note(stack, frame)
            return
        for i in range(len(stack) - 1, -1, -1):  # frames entered before the hook was set are not there
            if stack[i][1] is frame:
                del stack[i:]
                break

    def _note(self, stack: list[tuple[str, FrameType]], frame: FrameType) -> None:
        files = collapsed(stack)
        if files[-1] in files[:-1] and len(set(files)) == len(files) - 1:  # the first file back on this stack
            self.reentries.setdefault(tuple(files), threading.current_thread().name)
        if frame.f_code is SUBMIT and not self.at_submit:
            self.at_submit = files
        if BUILDER in files and (len(files), len(stack)) > self.builder[:2]:
            self.builder = (len(files), len(stack), files)
        if files[-1] == KERNELS and files.count(KERNELS) == 1 and len(files) > len(self.at_kernels) \
                and threading.current_thread().name == "llaisys-engine":
            self.at_kernels = files


def traced_chat_completion(model: Any) -> Tracer:
    """A server for ``model``; one chat completion to warm it, then one traced."""
    tracer = Tracer()
    threading.setprofile(tracer)  # the server's threads (uvicorn's, the engine's, the workers') start below
    try:
        with running(create_app(ServerOptions(), model=model)) as url:
            client = client_for(url)
            name = client.models.list().data[0].id
            warm = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hello"}],
                                                  max_tokens=2, temperature=0)
            assert warm.choices[0].finish_reason in ("stop", "length")
            sys.setprofile(tracer)
            tracer.recording = True
            try:
                reply = client.chat.completions.create(model=name, max_tokens=2, temperature=0,
                                                       messages=[{"role": "user", "content": "Name a colour."}])
            finally:
                tracer.recording = False
                sys.setprofile(None)
    finally:
        threading.setprofile(None)
    assert reply.choices[0].finish_reason in ("stop", "length")
    return tracer


def test_chat_completion_enters_each_file_once(smollm2_model):
    tracer = traced_chat_completion(smollm2_model)

    found = {files: thread for files, thread in tracer.reentries.items() if short(files[-1]) not in KNOWN_REENTERED}
    came_back = "\n".join(f"  {thread}: " + " > ".join(map(short, files)) for files, thread in list(found.items())[:5])
    assert not found, f"a file entered again on a stack with another llaisys file between:\n{came_back}"
    known = sorted({short(files[-1]) for files in tracer.reentries})
    print(f"entered again, outside the server (KNOWN_REENTERED): {', '.join(known) or 'none'}")

    parts = {"handler, at EngineThread submission": tracer.at_submit,
             "builder (server/requests.py), at its deepest": tracer.builder[2],
             "engine thread, entering the kernels": tracer.at_kernels}
    assert all(parts.values()), f"the trace missed a part of the path: {parts}"
    path: list[str] = []
    for files in parts.values():
        path += [f for f in files if f not in path]
    server = [f for f in path if f.startswith(SERVER)]
    report = (f"the request's main path, {len(path)} files ({len(server)} in the server):\n"
              + "\n".join(f"  {i + 1}. {short(f)}" for i, f in enumerate(path)) + "\nby part:\n"
              + "\n".join(f"  {name}: " + " > ".join(map(short, files)) for name, files in parts.items()))
    print(report)
    assert tracer.at_submit[0].startswith(SERVER) and short(tracer.at_submit[-1]) == "engine/thread.py", report
    assert len(server) <= MAX_SERVER_FILES, report
    main = [short(f) for f in path if short(f) not in BESIDE]
    assert len(main) <= MAX_HANDLER_TO_KERNEL, f"from the handler to the kernel: {' > '.join(main)}\n{report}"
