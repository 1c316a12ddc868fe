"""The chat UI's conversation store (SQLite) and its REST API under /api/conversations.

The API runs through FastAPI's TestClient on a bare app with only ``ui.mount``: no model.
"""
from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llaisys.server import store as store_module
from llaisys.server.protocol import MAX_JSON_DEPTH
from llaisys.server.store import ConversationStore, NotFoundError


@pytest.fixture
def store(tmp_path: Path):
    s = ConversationStore(tmp_path / "chat.sqlite3")
    yield s
    s.close()


def contents(conv: dict[str, Any], ids: list[str]) -> list[str]:
    by_id = {m["id"]: m for m in conv["messages"]}
    return [by_id[i]["content"] for i in ids]


# ---------------------------------------------------------------- the store

def test_create_list_rename_delete(store: ConversationStore) -> None:
    a = store.create_conversation(title="  first   chat ", system_prompt="Be brief.", settings={"temperature": 0.5})
    b = store.create_conversation()
    assert a["title"] == "first chat" and a["system_prompt"] == "Be brief." and a["settings"] == {"temperature": 0.5}
    assert a["messages"] == [] and a["path"] == [] and a["active_leaf"] is None
    assert [c["id"] for c in store.list_conversations()] == [b["id"], a["id"]]  # newest first

    renamed = store.update_conversation(a["id"], {"title": "renamed", "settings": {"seed": 3, "top_p": None}})
    assert renamed["title"] == "renamed" and renamed["settings"] == {"seed": 3}  # settings are replaced whole
    assert [c["id"] for c in store.list_conversations()] == [a["id"], b["id"]]  # an update moves it up

    store.delete_conversation(a["id"])
    assert [c["id"] for c in store.list_conversations()] == [b["id"]]
    with pytest.raises(NotFoundError):
        store.get_conversation(a["id"])
    with pytest.raises(NotFoundError):
        store.delete_conversation(a["id"])


def test_message_tree_branches_and_active_path(store: ConversationStore) -> None:
    cid = store.create_conversation()["id"]
    q1 = store.add_message(cid, "user", "What is 2+2?")
    a1 = store.add_message(cid, "assistant", "4", parent_id=q1["id"], meta={"tokens_per_s": 12.5})
    q2 = store.add_message(cid, "user", "And 3+3?", parent_id=a1["id"])
    a2 = store.add_message(cid, "assistant", "6", parent_id=q2["id"])
    conv = store.get_conversation(cid)
    assert conv["title"] == "What is 2+2?"  # an untitled chat takes its first user message
    assert conv["path"] == [q1["id"], a1["id"], q2["id"], a2["id"]] and conv["active_leaf"] == a2["id"]
    assert conv["messages"][1]["meta"] == {"tokens_per_s": 12.5}

    # editing the second question: a sibling of q2, answered; the old branch stays
    q2b = store.add_message(cid, "user", "And 5+5?", parent_id=a1["id"])
    a2b = store.add_message(cid, "assistant", "10", parent_id=q2b["id"])
    conv = store.get_conversation(cid)
    assert contents(conv, conv["path"]) == ["What is 2+2?", "4", "And 5+5?", "10"]
    assert len(conv["messages"]) == 6
    assert [m["id"] for m in conv["messages"] if m["parent_id"] == a1["id"]] == [q2["id"], q2b["id"]]

    conv = store.update_conversation(cid, {"active_leaf": a2["id"]})  # switch back
    assert contents(conv, conv["path"]) == ["What is 2+2?", "4", "And 3+3?", "6"]
    # a new first message is a second root
    root = store.add_message(cid, "user", "Start over", activate=False)
    conv = store.get_conversation(cid)
    assert root["parent_id"] is None and conv["active_leaf"] == a2["id"]
    assert store.update_conversation(cid, {"active_leaf": None})["path"] == []

    other = store.create_conversation()["id"]
    with pytest.raises(NotFoundError, match="no message"):
        store.add_message(other, "user", "x", parent_id=q1["id"])  # a parent from another conversation
    with pytest.raises(NotFoundError):
        store.update_conversation(other, {"active_leaf": a2["id"]})
    with pytest.raises(NotFoundError):
        store.add_message("nope", "user", "x")


def test_streamed_answer_is_saved_in_place(store: ConversationStore) -> None:
    cid = store.create_conversation()["id"]
    q = store.add_message(cid, "user", "Tell me a story")
    a = store.add_message(cid, "assistant", "", parent_id=q["id"], meta={"status": "streaming", "model": "m"})
    store.update_message(cid, a["id"], {"content": "Once upon"})
    done = store.update_message(cid, a["id"], {"content": "Once upon a time", "meta": {"status": "stopped",
                                                                                        "model": None, "tps": 9.0}})
    assert done["content"] == "Once upon a time" and done["meta"] == {"status": "stopped", "tps": 9.0}
    assert store.update_message(cid, a["id"], {"meta": {"x": 1}})["content"] == "Once upon a time"
    with pytest.raises(ValueError, match="unknown field"):
        store.update_message(cid, a["id"], {"role": "user"})
    with pytest.raises(NotFoundError):
        store.update_message(cid, "nope", {"content": ""})


def test_search_titles_and_message_text(store: ConversationStore) -> None:
    a = store.create_conversation(title="Rust lifetimes")["id"]
    b = store.create_conversation()["id"]
    store.add_message(b, "user", "How do I sort a list in Python?")
    store.add_message(b, "assistant", "Use sorted(xs) or xs.sort(); 100% in place for the second.")
    c = store.create_conversation(title="Other")["id"]
    store.add_message(c, "user", "nothing to see")

    assert [r["id"] for r in store.list_conversations("rust")] == [a]
    hits = store.list_conversations("SORTED(")
    assert [r["id"] for r in hits] == [b] and "sorted(xs)" in hits[0]["snippet"]
    assert [r["id"] for r in store.list_conversations("100%")] == [b]
    assert [r["id"] for r in store.list_conversations("%")] == [b]
    assert store.list_conversations("_") == []  # wildcards are matched literally
    assert len(store.list_conversations("  ")) == 3
    assert len(store.list_conversations(limit=2)) == 2


def test_export_import_round_trip(store: ConversationStore) -> None:
    cid = store.create_conversation(title="Trip", system_prompt="sys", settings={"max_tokens": 64})["id"]
    q = store.add_message(cid, "user", "q")
    a1 = store.add_message(cid, "assistant", "a1", parent_id=q["id"], meta={"status": "done"})
    store.add_message(cid, "assistant", "a2", parent_id=q["id"])
    store.update_conversation(cid, {"active_leaf": a1["id"]})
    document = json.loads(json.dumps(store.export_conversation(cid)))  # through JSON, as a file would go

    (made,) = store.import_conversations(document)
    assert made["id"] != cid and made["title"] == "Trip"
    before, after = store.get_conversation(cid), store.get_conversation(made["id"])
    for key in ("title", "system_prompt", "settings"):
        assert after[key] == before[key]
    assert contents(after, after["path"]) == ["q", "a1"]
    old = {(m["role"], m["content"], json.dumps(m["meta"])) for m in before["messages"]}
    assert {(m["role"], m["content"], json.dumps(m["meta"])) for m in after["messages"]} == old
    assert not {m["id"] for m in before["messages"]} & {m["id"] for m in after["messages"]}

    # several at once; children listed before their parents are fine
    body = document["conversation"]
    shuffled = {**body, "messages": body["messages"][::-1]}
    made = store.import_conversations({"conversations": [shuffled, {"title": "empty"}]})
    assert [c["title"] for c in made] == ["Trip", "empty"]
    assert contents(store.get_conversation(made[0]["id"]), store.get_conversation(made[0]["id"])["path"]) == ["q", "a1"]


@pytest.mark.parametrize("bad, message", [
    ({"messages": [{"id": "a", "parent_id": "b", "role": "user", "content": "x"},
                   {"id": "b", "parent_id": "a", "role": "user", "content": "y"}]}, "cycle"),
    ({"messages": [{"id": "a", "parent_id": "zz", "role": "user", "content": "x"}]}, "not in the list"),
    ({"messages": [{"id": "a", "role": "robot", "content": "x"}]}, "role must be"),
    ({"messages": [{"id": "a", "role": "user", "content": "x"}], "active_leaf": "q"}, "active_leaf"),
    ({"messages": [{"id": "a", "role": "user", "content": "x"}, {"id": "a", "role": "user", "content": "y"}]},
     "twice"),
    ({"messages": [{"role": "user", "content": "x"}]}, "id must be"),
    ({"messages": "none"}, "messages must be a list"),
    ({"settings": {"temperature": 9}}, "out of range"),
    ("text", "must be an object"),
])
def test_import_refuses_bad_conversations_whole(store: ConversationStore, bad: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message) as info:
        store.import_conversations({"conversations": [{"title": "fine"}, bad]})
    assert "conversations[1]" in str(info.value)
    assert store.list_conversations() == []  # nothing half-imported


@pytest.mark.parametrize("bad, message", [
    ({"format": "something-else", "conversation": {}}, "format must be"),
    ({"version": 99, "conversation": {}}, "version"),
    ({"nothing": 1}, "needs a 'conversation'"),
    ([{"conversation": {}}], "must be a JSON object"),
])
def test_import_refuses_bad_documents(store: ConversationStore, bad: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        store.import_conversations(bad)


@pytest.mark.parametrize("settings, message", [
    ({"temperature": -0.1}, "out of range"), ({"temperature": "hot"}, "must be a number"),
    ({"top_p": 0}, "out of range"), ({"top_p": 1.5}, "out of range"), ({"max_tokens": 0}, "out of range"),
    ({"max_tokens": 2.5}, "must be an integer"), ({"seed": True}, "must be an integer"),
    ({"seed": -1}, "out of range"), ({"temperature": float("nan")}, "must be a number"),
    ({"top_k": 3}, "unknown setting"), ([1], "must be an object"),
])
def test_settings_are_checked(store: ConversationStore, settings: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        store.create_conversation(settings=settings)


def test_persists_across_stores_on_one_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "chat.sqlite3"
    first = ConversationStore(path)
    cid = first.create_conversation(title="kept")["id"]
    mid = first.add_message(cid, "user", "hello")["id"]
    second = ConversationStore(path)  # another process would see the same
    assert second.get_conversation(cid)["path"] == [mid]
    first.close()
    second.close()
    again = ConversationStore(path)
    assert again.get_conversation(cid)["title"] == "kept"
    again.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_refuses_a_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(ValueError, match="schema version 99"):
        ConversationStore(path).list_conversations()


def test_default_path_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert store_module.default_path() == tmp_path / "llaisys" / "conversations.sqlite3"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert store_module.default_path() == tmp_path / ".local" / "share" / "llaisys" / "conversations.sqlite3"
    assert ConversationStore().path == store_module.default_path()  # opening is lazy: nothing made yet
    assert not (tmp_path / ".local").exists()


def test_threads_share_a_store(store: ConversationStore) -> None:
    cid = store.create_conversation()["id"]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(20):
                m = store.add_message(cid, "user", f"{k}-{i}", activate=False)
                store.update_message(cid, m["id"], {"meta": {"k": k}})
                store.list_conversations("1-")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(store.get_conversation(cid)["messages"]) == 80


# ---------------------------------------------------------------- the REST API

fastapi = pytest.importorskip("fastapi")


def make_client(tmp_path: Path, api_key: str | None = None):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from llaisys.server import ui

    app = FastAPI()
    ui.mount(app, SimpleNamespace(db_path=tmp_path / "api.sqlite3", api_key=api_key))
    return TestClient(app)


@pytest.fixture
def client(tmp_path: Path):
    with make_client(tmp_path) as c:
        yield c


def test_api_crud_and_branches(client) -> None:
    r = client.post("/api/conversations", json={"title": "API", "settings": {"temperature": 0.2}})
    assert r.status_code == 201
    cid = r.json()["id"]
    base = f"/api/conversations/{cid}"
    q = client.post(f"{base}/messages", json={"role": "user", "content": "hi"})
    assert q.status_code == 201
    qid = q.json()["id"]
    a1 = client.post(f"{base}/messages", json={"role": "assistant", "content": "", "parent_id": qid,
                                               "meta": {"status": "streaming"}}).json()
    r = client.patch(f"{base}/messages/{a1['id']}", json={"content": "hello!", "meta": {"status": "done"}})
    assert r.status_code == 200 and r.json()["content"] == "hello!" and r.json()["meta"] == {"status": "done"}
    a2 = client.post(f"{base}/messages", json={"role": "assistant", "content": "hey", "parent_id": qid}).json()

    conv = client.get(base).json()
    assert conv["path"] == [qid, a2["id"]] and len(conv["messages"]) == 3
    conv = client.patch(base, json={"active_leaf": a1["id"], "title": "Renamed", "system_prompt": "S"}).json()
    assert conv["path"] == [qid, a1["id"]] and conv["title"] == "Renamed" and conv["system_prompt"] == "S"
    assert client.get(base).json()["settings"] == {"temperature": 0.2}

    listed = client.get("/api/conversations", params={"q": "HELLO"}).json()["data"]
    assert [c["id"] for c in listed] == [cid] and listed[0]["snippet"] == "hello!"
    assert client.get("/api/conversations", params={"q": "absent"}).json()["data"] == []

    assert client.delete(base).status_code == 204
    assert client.get(base).status_code == 404
    assert client.get("/api/conversations").json()["data"] == []


def test_api_export_import(client) -> None:
    cid = client.post("/api/conversations", json={"title": "Export me"}).json()["id"]
    q = client.post(f"/api/conversations/{cid}/messages", json={"role": "user", "content": "x"}).json()
    client.post(f"/api/conversations/{cid}/messages", json={"role": "assistant", "content": "y", "parent_id": q["id"]})
    r = client.get(f"/api/conversations/{cid}/export")
    assert r.status_code == 200 and 'filename="Export-me.json"' in r.headers["content-disposition"]
    r = client.post("/api/conversations/import", content=r.content, headers={"Content-Type": "application/json"})
    assert r.status_code == 201
    (made,) = r.json()["data"]
    conv = client.get(f"/api/conversations/{made['id']}").json()
    assert conv["title"] == "Export me" and contents(conv, conv["path"]) == ["x", "y"]


@pytest.mark.parametrize("method, path, body, status, message", [
    ("POST", "/api/conversations", b"{not json", 400, "not valid JSON"),
    ("POST", "/api/conversations", b"[1, 2]", 400, "must be a JSON object"),
    ("POST", "/api/conversations", {"title": 5}, 400, "title must be a string"),
    ("POST", "/api/conversations", {"colour": "red"}, 400, "unknown field(s) colour"),
    ("POST", "/api/conversations", {"settings": {"temperature": 3}}, 400, "out of range"),
    ("POST", "{c}/messages", {"content": "x"}, 400, "missing field(s) role"),
    ("POST", "{c}/messages", {"role": "system", "content": "x"}, 400, "role must be one of"),
    ("POST", "{c}/messages", {"role": "user", "content": None}, 400, "content must be a string"),
    ("POST", "{c}/messages", {"role": "user", "content": "x", "parent_id": "nope"}, 404, "no message"),
    ("POST", "{c}/messages", {"role": "user", "content": "x", "activate": "yes"}, 400, "activate"),
    ("POST", "{c}/messages", b"", 400, "needs a JSON object"),
    ("PATCH", "{c}", {"active_leaf": "nope"}, 404, "no message"),
    ("PATCH", "{c}", {"id": "x"}, 400, "unknown field(s) id"),
    ("PATCH", "{c}/messages/nope", {"content": "x"}, 404, "no message"),
    ("GET", "/api/conversations/nope", None, 404, "no conversation"),
    ("DELETE", "/api/conversations/nope", None, 404, "no conversation"),
    ("GET", "/api/conversations/nope/export", None, 404, "no conversation"),
    ("POST", "/api/conversations/nope/messages", {"role": "user", "content": "x"}, 404, "no conversation"),
    ("GET", "/api/conversations?limit=lots", None, 400, "limit must be an integer"),
    ("POST", "/api/conversations/import", {"conversation": {"messages": 3}}, 400, "messages must be a list"),
])
def test_api_errors(client, method: str, path: str, body: Any, status: int, message: str) -> None:
    cid = client.post("/api/conversations").json()["id"]
    path = path.replace("{c}", f"/api/conversations/{cid}")
    json_type = {"Content-Type": "application/json"}
    kwargs = ({"content": body, "headers": json_type} if isinstance(body, bytes) else
              {"json": body} if body is not None else {})
    r = client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"]


def test_api_wants_json_bodies(client) -> None:
    # a form or text/plain POST is what another site's page may send without asking (no CORS preflight)
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": kind} if kind else {}
        r = client.post("/api/conversations", content=b'{"title": "x"}', headers=headers)
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    ok = client.post("/api/conversations", content=b'{"title": "x"}',
                     headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 201
    assert client.post("/api/conversations").status_code == 201  # no body: an empty conversation
    assert [c["title"] for c in client.get("/api/conversations").json()["data"]] == ["", "x"]


def test_api_key_guards_the_api_only(tmp_path: Path) -> None:
    with make_client(tmp_path, api_key="sesame") as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = c.get("/api/conversations", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert "API key" in r.json()["error"]["message"]
        assert c.post("/api/conversations/import", json=[]).status_code == 401  # before parsing
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/api/conversations", headers={"Authorization": "bearer  sesame"}).status_code == 200
        ok = {"Authorization": "Bearer sesame"}
        assert c.post("/api/conversations", headers=ok).status_code == 201
        assert len(c.get("/api/conversations", headers=ok).json()["data"]) == 1
        page = c.get("/")  # the page asks for the key itself
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for name in ("app.js", "markdown.js", "style.css"):
            assert c.get(f"/ui/{name}").status_code == 200


def test_page_uses_only_its_own_files(client) -> None:
    html = client.get("/").text
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert refs and all(r.startswith("ui/") or r.startswith("data:") for r in refs), refs  # no CDN
    assert not re.search(r"<script>|\son\w+=", html)  # no inline code (the CSP forbids it)
    for ref in refs:
        if ref.startswith("ui/"):
            assert client.get("/" + ref).status_code == 200, ref


# ---------------------------------------------------------------- bad data: meta types, deep JSON

BAD_META = {"tokens_per_s": "fast"}


@pytest.mark.parametrize("meta, message", [
    (BAD_META, "meta.tokens_per_s must be a number >= 0 or null, got 'fast'"),
    ({"completion_tokens": 2.5}, "meta.completion_tokens must be an integer >= 0"),
    ({"prompt_tokens": True}, "meta.prompt_tokens must be an integer >= 0"),
    ({"ttft_s": -1}, "meta.ttft_s must be a number >= 0"),
    ({"status": "exploded"}, "meta.status must be one of streaming, done, stopped, error"),
    ({"error": {"message": "x"}}, "meta.error must be a string"),
    ({"sampling": {"temperature": "hot"}}, "meta.sampling must be an object of numbers"),
    ({"reasoning": ["thought"]}, "meta.reasoning must be a string"),
    ({"reasoning": "x" * (store_module.MAX_CONTENT + 1)}, "meta.reasoning must be a string of at most"),
    ({"deep": json.loads("[" * 20 + "]" * 20)}, "nests more than 16 levels"),
])
def test_meta_types_are_checked(store: ConversationStore, meta: dict, message: str) -> None:
    cid = store.create_conversation()["id"]
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        store.add_message(cid, "assistant", "x", meta=meta)
    mid = store.add_message(cid, "assistant", "x", meta={"status": "done"})["id"]
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        store.update_message(cid, mid, {"meta": meta})
    assert store.get_conversation(cid)["messages"][0]["meta"] == {"status": "done"}


def test_meta_keeps_good_values_and_free_keys(store: ConversationStore) -> None:
    cid = store.create_conversation()["id"]
    meta = {"status": "done", "model": None, "finish_reason": "length", "prompt_tokens": 7, "completion_tokens": 3,
            "tokens_per_s": 12, "ttft_s": 0.25, "error": "", "sampling": {"temperature": 0.3, "max_tokens": 512},
            "reasoning": "2 + 2: add them.", "mine": {"anything": [1, "two"]}}
    assert store.add_message(cid, "assistant", "x", meta=meta)["meta"] == meta


def test_meta_reasoning_may_be_as_long_as_a_message(store: ConversationStore) -> None:
    # a reasoning model thinks for thousands of tokens: meta.reasoning is not counted in MAX_META
    cid = store.create_conversation()["id"]
    thought = "hmm, " * (store_module.MAX_META // 2)
    mid = store.add_message(cid, "assistant", "", meta={"status": "streaming", "reasoning": thought})["id"]
    done = store.update_message(cid, mid, {"content": "4", "meta": {"status": "done", "reasoning": thought + "4."}})
    assert done["meta"] == {"status": "done", "reasoning": thought + "4."}
    with pytest.raises(ValueError, match=f"at most {store_module.MAX_META} are allowed"):  # the rest still is
        store.update_message(cid, mid, {"meta": {"other": thought}})
    (made,) = store.import_conversations(store.export_conversation(cid))  # kept through export and import
    assert store.get_conversation(made["id"])["messages"][0]["meta"]["reasoning"] == thought + "4."


def test_import_refuses_bad_meta_types(store: ConversationStore) -> None:
    document = {"conversation": {"title": "bad", "messages": [
        {"id": "q", "role": "user", "content": "hi"},
        {"id": "a", "parent_id": "q", "role": "assistant", "content": "hello", "meta": BAD_META}]}}
    with pytest.raises(TypeError, match=re.escape("conversations[0]: messages[1].meta.tokens_per_s must be a "
                                                  "number >= 0 or null, got 'fast'")):
        store.import_conversations(document)
    assert store.list_conversations() == []


def test_stored_meta_of_a_wrong_type_is_dropped_when_read(store: ConversationStore) -> None:
    # rows written before the checks (or by hand): the API never hands the page a wrong type
    cid = store.create_conversation()["id"]
    a = store.add_message(cid, "assistant", "kept", meta={"status": "done"})["id"]
    b = store.add_message(cid, "assistant", "kept too")["id"]
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE messages SET meta = ? WHERE id = ?",
                   (json.dumps({"status": "done", "tokens_per_s": "fast", "completion_tokens": [3], "reasoning": 1,
                                "x": "free"}), a))
        db.execute("UPDATE messages SET meta = ? WHERE id = ?", ('"not an object"', b))
    by_id = {m["id"]: m for m in store.get_conversation(cid)["messages"]}
    assert by_id[a]["meta"] == {"status": "done", "x": "free"} and by_id[a]["content"] == "kept"
    assert by_id[b]["meta"] == {}
    assert store.update_message(cid, a, {"meta": {"ttft_s": 0.5}})["meta"] == {"status": "done", "x": "free",
                                                                               "ttft_s": 0.5}
    (made,) = store.import_conversations(store.export_conversation(cid))  # a clean export imports again
    assert len(store.get_conversation(made["id"])["messages"]) == 2


def test_stored_values_that_are_not_json_are_dropped_when_read(tmp_path: Path) -> None:
    # a meta or settings column that is not JSON, or holds a NaN, and times JSON cannot carry (all
    # written by hand, or by an older import): the rest of the conversation still reads and exports
    with make_client(tmp_path) as client:
        cid = client.post("/api/conversations", json={"settings": {"seed": 3}}).json()["id"]
        a = client.post(f"/api/conversations/{cid}/messages", json={"role": "user", "content": "q"}).json()["id"]
        b = client.post(f"/api/conversations/{cid}/messages", json={"role": "assistant", "content": "r",
                                                                    "parent_id": a}).json()["id"]
        with sqlite3.connect(tmp_path / "api.sqlite3") as db:
            db.execute("UPDATE messages SET meta = ? WHERE id = ?", ("{not json", a))
            db.execute("UPDATE messages SET meta = ?, created = ? WHERE id = ?",
                       ('{"status": "done", "x": [1, NaN], "tokens_per_s": Infinity, "y": 2}', float("inf"), b))
            db.execute("UPDATE conversations SET settings = ?, updated = ? WHERE id = ?",
                       ('{"seed": 3, "temperature": NaN}', float("-inf"), cid))
        conv = client.get(f"/api/conversations/{cid}")
        assert conv.status_code == 200, conv.text
        by_id = {m["id"]: m for m in conv.json()["messages"]}
        assert by_id[a]["meta"] == {} and by_id[a]["content"] == "q"
        assert by_id[b]["meta"] == {"status": "done", "y": 2} and by_id[b]["created"] is None
        assert conv.json()["settings"] == {"seed": 3} and conv.json()["updated"] is None
        assert [c["id"] for c in client.get("/api/conversations").json()["data"]] == [cid]
        export = client.get(f"/api/conversations/{cid}/export")
        assert export.status_code == 200 and json.loads(export.content)["conversation"]["messages"][1]["meta"] == {
            "status": "done", "y": 2}
        r = client.post("/api/conversations/import", content=export.content,
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 201, r.text
        patched = client.patch(f"/api/conversations/{cid}/messages/{b}", json={"meta": {"ttft_s": 0.5}})
        assert patched.json()["meta"] == {"status": "done", "y": 2, "ttft_s": 0.5}


@pytest.mark.parametrize("item, message", [
    ({"created": float("nan")}, "created must be a number"),
    ({"created": float("inf")}, "created must be a number"),
    ({"created": 10**400}, "created must be in [0, 1e11)"),
    ({"created": "yesterday"}, "created must be a number"),
    ({"messages": [{"id": "a", "role": "user", "content": "x", "created": float("-inf")}]},
     "messages[0].created must be a number"),
    ({"settings": {"temperature": 10**400}}, "setting temperature=1000"),
    ({"settings": {"top_p": float("nan")}}, "setting top_p must be a number"),
])
def test_import_times_and_settings_must_be_finite(store: ConversationStore, item: dict, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=re.escape(f"conversations[0]: {message}")):
        store.import_conversations({"conversation": item})
    assert store.list_conversations() == []
    with pytest.raises((TypeError, ValueError), match="setting temperature"):
        store.create_conversation(settings={"temperature": -(10**400)})


def test_import_of_a_long_chain_leaf_first_is_linear(store: ConversationStore) -> None:
    n = 40_000  # a chain listed from its leaf up: quadratic, this took 17 s
    chain = [{"id": f"m{i}", "parent_id": f"m{i - 1}" if i else None, "role": ("user", "assistant")[i % 2],
              "content": f"{i}"} for i in range(n)]
    start = time.monotonic()
    (made,) = store.import_conversations({"conversation": {"messages": chain[::-1], "active_leaf": f"m{n - 1}"}})
    conv = store.get_conversation(made["id"])
    took = time.monotonic() - start
    assert contents(conv, conv["path"]) == [str(i) for i in range(n)]
    assert took < 6.0, took


def test_api_refuses_bad_meta_types(client) -> None:
    document = {"conversation": {"title": "bad", "messages": [
        {"id": "a", "role": "assistant", "content": "hello", "meta": BAD_META}]}}
    r = client.post("/api/conversations/import", json=document)
    assert r.status_code == 400, r.text
    assert "messages[0].meta.tokens_per_s must be a number >= 0 or null, got 'fast'" in r.json()["error"]["message"]
    assert client.get("/api/conversations").json()["data"] == []
    cid = client.post("/api/conversations").json()["id"]
    r = client.post(f"/api/conversations/{cid}/messages", json={"role": "assistant", "content": "x", "meta": BAD_META})
    assert r.status_code == 400 and "tokens_per_s" in r.json()["error"]["message"]


DEEP = 100_000


@pytest.mark.parametrize("body", [
    b"[" * DEEP + b"]" * DEEP,
    b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    b'{"meta": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    b"[" * DEEP,  # not even valid JSON
], ids=["array", "object", "inside", "unclosed"])
@pytest.mark.parametrize("method, path", [
    ("POST", "/api/conversations"), ("POST", "/api/conversations/import"), ("PATCH", "{c}"),
    ("POST", "{c}/messages"), ("PATCH", "{c}/messages/{m}"),
])
def test_api_refuses_deeply_nested_json(client, method: str, path: str, body: bytes) -> None:
    cid = client.post("/api/conversations").json()["id"]
    mid = client.post(f"/api/conversations/{cid}/messages", json={"role": "user", "content": "q"}).json()["id"]
    path = path.replace("{c}", f"/api/conversations/{cid}").replace("{m}", mid)
    r = client.request(method, path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert f"at most {MAX_JSON_DEPTH} levels" in r.json()["error"]["message"]


def test_brackets_in_strings_and_modest_nesting_are_fine(client) -> None:
    title = "[[[{{{" * 100
    r = client.post("/api/conversations", json={"title": title[:200]})
    assert r.status_code == 201 and r.json()["title"] == title[:200]
    cid = r.json()["id"]
    meta = {"x": json.loads("[" * 10 + "]" * 10), "quote": 'a "[" b \\ ['}
    r = client.post(f"/api/conversations/{cid}/messages", json={"role": "assistant", "content": "]]]" * 100,
                                                                "meta": meta})
    assert r.status_code == 201 and r.json()["meta"] == meta


# ---------------------------------------------------------------- the page's defaults

def test_settings_route_serves_the_models_defaults(tmp_path: Path) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from llaisys.generation.defaults import CHAT_MAX_TOKENS, sampling_defaults
    from llaisys.server import ui

    app = FastAPI()
    ui.mount(app, SimpleNamespace(db_path=tmp_path / "s.sqlite3", api_key=None))
    with TestClient(app) as c:
        r = c.get("/api/settings")  # the UI alone: no model
        assert r.status_code == 503 and "no model" in r.json()["error"]["message"]
        app.state.service = SimpleNamespace(status="loading", model=None)
        r = c.get("/api/settings")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"

        model = SimpleNamespace(generation_defaults={})
        app.state.service = SimpleNamespace(status="ready", model=model, max_model_len=8192)
        fallback = sampling_defaults({})
        assert c.get("/api/settings").json() == {"temperature": fallback["temperature"], "top_p": fallback["top_p"],
                                                 **fallback, "max_tokens": CHAT_MAX_TOKENS, "max_model_len": 8192}
        model.generation_defaults = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                     "max_new_tokens": 9}
        assert c.get("/api/settings").json() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                 "max_tokens": CHAT_MAX_TOKENS, "max_model_len": 8192}
        model.generation_defaults = {"do_sample": False}
        got = c.get("/api/settings").json()
        assert got["temperature"] == 0.0 and got["top_p"] is None  # None: the server's default

        app.state.service = SimpleNamespace(status="failed", model=None, failure=lambda: "the model failed to load: x")
        r = c.get("/api/settings")
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]


def test_settings_route_wants_the_key(tmp_path: Path) -> None:
    with make_client(tmp_path, api_key="sesame") as c:
        assert c.get("/api/settings").status_code == 401
        assert c.get("/api/settings", headers={"Authorization": "Bearer sesame"}).status_code == 503


# ---------------------------------------------------------------- images of user messages

def image_file(kind: str = "PNG", size: tuple[int, int] = (6, 4), seed: int = 0) -> bytes:
    """A small encoded picture of random pixels (``kind``: a Pillow format name)."""
    import io

    import numpy as np

    from conftest import random_image

    out = io.BytesIO()
    random_image(np.random.default_rng(seed), *size).save(out, format=kind)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    import base64

    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_images_are_kept_with_a_user_message(store: ConversationStore) -> None:
    png, jpeg = image_file("PNG"), image_file("JPEG", seed=1)
    images = [{"url": data_url(png)}, {"url": data_url(jpeg, "image/jpeg")}]
    cid = store.create_conversation()["id"]
    q = store.add_message(cid, "user", "What is in these?", images=images)
    assert q["images"] == images
    a = store.add_message(cid, "assistant", "Noise.", parent_id=q["id"])
    assert a["images"] == []
    with sqlite3.connect(store.path) as db:  # the file's bytes, not base64
        rows = db.execute("SELECT position, media_type, data FROM message_images ORDER BY position").fetchall()
    assert rows == [(0, "image/png", png), (1, "image/jpeg", jpeg)]

    store.close()  # read back from the file, as after a restart
    again = ConversationStore(store.path)
    conv = again.get_conversation(cid)
    by_id = {m["id"]: m for m in conv["messages"]}
    assert by_id[q["id"]]["images"] == images and by_id[a["id"]]["images"] == []
    assert again.update_message(cid, q["id"], {"content": "And now?"})["images"] == images
    # the type is the file's: a PNG sent as image/jpeg is kept as image/png
    mislabeled = again.add_message(cid, "user", "x", images=[{"url": data_url(png, "image/jpeg")}])
    assert mislabeled["images"] == [{"url": data_url(png)}]
    again.delete_conversation(cid)  # its images go with it
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT COUNT(*) FROM message_images").fetchone()[0] == 0
    again.close()


def test_export_import_keeps_images(store: ConversationStore) -> None:
    images = [{"url": data_url(image_file("GIF"), "image/gif")}, {"url": data_url(image_file("WEBP"), "image/webp")},
              {"url": data_url(image_file("BMP"), "image/bmp")}]
    cid = store.create_conversation(title="Pictures")["id"]
    q = store.add_message(cid, "user", "", images=images)  # images alone, no text
    store.add_message(cid, "assistant", "three", parent_id=q["id"])
    document = json.loads(json.dumps(store.export_conversation(cid)))
    assert document["version"] == 2 and document["conversation"]["messages"][0]["images"] == images
    assert "images" not in document["conversation"]["messages"][1]
    (made,) = store.import_conversations(document)
    conv = store.get_conversation(made["id"])
    assert [m["images"] for m in conv["messages"]] == [images, []]
    assert contents(conv, conv["path"]) == ["", "three"]

    plain = store.create_conversation(title="Words")["id"]  # an older llaisys imports it
    store.add_message(plain, "user", "hi")
    document = store.export_conversation(plain)
    assert document["version"] == 1 and "images" not in document["conversation"]["messages"][0]


PNG_URL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGNoAAAAggCBd81ytgAAAABJ"
           "RU5ErkJggg==")  # one grey pixel


@pytest.mark.parametrize("images, message", [
    ({"url": PNG_URL}, "images must be a list"),
    (["data:image/png;base64,AAAA"], "images[0] must be an object with only a 'url'"),
    ([{"url": PNG_URL, "detail": "high"}], "images[0] must be an object with only a 'url'"),
    ([{"url": "https://example.org/cat.png"}], "images[0].url: not a data URL"),
    ([{"url": "data:text/plain;base64,aGk="}], "images[0].url: data URL media type is 'text/plain'"),
    ([{"url": "data:image/png,rawbytes"}], "images[0].url: data URL payload is not base64-encoded"),
    ([{"url": "data:image/png;base64,%%%"}], "images[0].url: data URL payload is not valid base64"),
    ([{"url": PNG_URL}, {"url": data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")}],
     "images[1] is not a PNG, JPEG, WebP, GIF or BMP image"),
    ([{"url": PNG_URL}] * (store_module.MAX_IMAGES + 1),
     f"images holds {store_module.MAX_IMAGES + 1} images; a message may carry at most {store_module.MAX_IMAGES}"),
])
def test_images_are_checked(store: ConversationStore, images: Any, message: str) -> None:
    cid = store.create_conversation()["id"]
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        store.add_message(cid, "user", "x", images=images)
    assert store.get_conversation(cid)["messages"] == []
    with pytest.raises((TypeError, ValueError), match=re.escape(f"conversations[0]: messages[0].{message}")):
        store.import_conversations({"conversation": {"messages": [
            {"id": "q", "role": "user", "content": "x", "images": images}]}})
    assert len(store.list_conversations()) == 1  # nothing imported


def test_image_limits(store: ConversationStore, monkeypatch: pytest.MonkeyPatch) -> None:
    cid = store.create_conversation()["id"]
    assert store_module.MAX_IMAGE_BYTES == 20 * 1024 * 1024  # what the server decodes (ImageLimits)
    png = image_file("PNG", (40, 40))
    monkeypatch.setattr(store_module, "MAX_IMAGE_BYTES", len(png) - 1)
    with pytest.raises(ValueError, match=re.escape(f"more than the limit of {len(png) - 1} bytes")):
        store.add_message(cid, "user", "big", images=[{"url": data_url(png)}])
    monkeypatch.setattr(store_module, "MAX_IMAGE_BYTES", len(png))
    assert len(store.add_message(cid, "user", "fits", images=[{"url": data_url(png)}])["images"]) == 1
    full = store.add_message(cid, "user", "many", images=[{"url": PNG_URL}] * store_module.MAX_IMAGES)
    assert len(full["images"]) == store_module.MAX_IMAGES
    with pytest.raises(ValueError, match="only a user message carries images"):
        store.add_message(cid, "assistant", "x", images=[{"url": PNG_URL}])
    assert store.add_message(cid, "user", "none", images=[])["images"] == []


V1_SCHEMA = """
CREATE TABLE conversations (id TEXT PRIMARY KEY, title TEXT NOT NULL, system_prompt TEXT NOT NULL,
    settings TEXT NOT NULL, active_leaf TEXT, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id TEXT REFERENCES messages(id) ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL,
    created REAL NOT NULL, meta TEXT NOT NULL);
CREATE INDEX messages_by_conversation ON messages(conversation_id, seq);
CREATE INDEX conversations_by_update ON conversations(updated);
PRAGMA user_version = 1;
"""


def test_a_version_1_database_still_loads(tmp_path: Path) -> None:
    # a file an llaisys without images wrote: it reads, and takes images from then on
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(V1_SCHEMA)
        db.execute("INSERT INTO conversations VALUES ('c1', 'Old chat', '', '{}', 'm2', 1.0, 2.0)")
        db.execute("INSERT INTO messages (id, conversation_id, parent_id, role, content, created, meta) "
                   "VALUES ('m1', 'c1', NULL, 'user', 'hello', 1.0, '{}'), "
                   "('m2', 'c1', 'm1', 'assistant', 'hi there', 2.0, '{\"status\": \"done\"}')")
    old = ConversationStore(path)
    conv = old.get_conversation("c1")
    assert conv["title"] == "Old chat" and contents(conv, conv["path"]) == ["hello", "hi there"]
    assert [m["images"] for m in conv["messages"]] == [[], []]
    assert [c["id"] for c in old.list_conversations("there")] == ["c1"]
    q = old.add_message("c1", "user", "and this?", parent_id="m2", images=[{"url": PNG_URL}])
    assert old.get_conversation("c1")["messages"][-1]["images"] == [{"url": PNG_URL}] == q["images"]
    old.delete_conversation("c1")
    old.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == store_module.SCHEMA_VERSION == 2
        assert db.execute("SELECT COUNT(*) FROM message_images").fetchone()[0] == 0
    # an export of an older llaisys (version 1, no images) imports
    fresh = ConversationStore(tmp_path / "new.sqlite3")
    (made,) = fresh.import_conversations({"format": "llaisys-conversation", "version": 1, "conversation": {
        "title": "v1", "messages": [{"id": "a", "role": "user", "content": "x", "meta": {}}]}})
    assert fresh.get_conversation(made["id"])["messages"][0]["images"] == []
    fresh.close()


def test_stored_images_of_a_wrong_type_are_dropped_when_read(store: ConversationStore) -> None:
    cid = store.create_conversation()["id"]
    mid = store.add_message(cid, "user", "two", images=[{"url": PNG_URL}, {"url": PNG_URL}])["id"]
    with sqlite3.connect(store.path) as db:  # written by hand
        db.execute("UPDATE message_images SET data = 'text' WHERE position = 0")
        db.execute("INSERT INTO message_images VALUES (?, 2, 'image/svg+xml', x'3c73')", (mid,))
    assert store.get_conversation(cid)["messages"][0]["images"] == [{"url": PNG_URL}]
    (made,) = store.import_conversations(store.export_conversation(cid))  # a clean export imports again
    assert store.get_conversation(made["id"])["messages"][0]["images"] == [{"url": PNG_URL}]


def test_api_messages_carry_images(client) -> None:
    cid = client.post("/api/conversations").json()["id"]
    base = f"/api/conversations/{cid}"
    r = client.post(f"{base}/messages", json={"role": "user", "content": "look", "images": [{"url": PNG_URL}]})
    assert r.status_code == 201, r.text
    assert r.json()["images"] == [{"url": PNG_URL}]
    conv = client.get(base).json()
    assert conv["messages"][0]["images"] == [{"url": PNG_URL}] and conv["title"] == "look"
    r = client.post(f"{base}/messages", json={"role": "user", "content": "x",
                                              "images": [{"url": "data:image/png;base64,AAAA"}]})
    assert r.status_code == 400 and "images[0] is not a PNG" in r.json()["error"]["message"]
    r = client.patch(f"{base}/messages/{conv['messages'][0]['id']}", json={"images": []})
    assert r.status_code == 400 and "unknown field" in r.json()["error"]["message"]
    export = client.get(f"{base}/export")
    r = client.post("/api/conversations/import", content=export.content, headers={"Content-Type": "application/json"})
    made = r.json()["data"][0]["id"]
    assert client.get(f"/api/conversations/{made}").json()["messages"][0]["images"] == [{"url": PNG_URL}]
