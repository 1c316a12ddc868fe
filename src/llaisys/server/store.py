"""Conversations of the chat UI, kept in SQLite.

A conversation has a title, a system prompt, sampling settings and a tree of messages: each
message names its parent (None for a first message), so editing a past message adds a sibling
and both branches stay. The conversation's ``active_leaf`` is the last message of the branch on
screen; ``path`` (root to leaf) is what the model sees. A user message may carry images, which
the API hands out as ``images: [{"url": "data:image/png;base64,..."}]`` (what an OpenAI
``image_url`` part holds) and the file keeps as their bytes (table ``message_images``).

Schema versions (``PRAGMA user_version``): 1, conversations and messages; 2 adds
``message_images``. Opening a file of an older version adds what it lacks (a version-1 file reads
as conversations without images); a newer version is refused.

One connection serves every thread, behind a lock (the UI's requests are small); the database is
in WAL mode, so another process may read it while the server writes. The file is opened on first
use, so mounting the UI touches no file until someone uses it.
"""
from __future__ import annotations

import base64
import json
import logging
import math
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..vision.images import ImageLimits, parse_data_url

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
EXPORT_FORMAT = "llaisys-conversation"
ROLES = ("user", "assistant")
MAX_TITLE = 200          # characters
MAX_CONTENT = 1 << 20    # characters of a message or a system prompt
MAX_META = 64 << 10      # characters of a message's meta as JSON, less its reasoning (up to MAX_CONTENT)
MAX_META_DEPTH = 16      # levels of arrays and objects in a message's meta
STATUSES = ("streaming", "done", "stopped", "error")  # an answer's meta.status
AUTO_TITLE = 60          # characters of the first user message that become an untitled chat's title
MAX_IMAGES = 8           # images one message may carry: what the server takes in a request by default
MAX_IMAGE_BYTES = ImageLimits().max_bytes  # an image's encoded bytes: what the server decodes at most
# The image types the page may attach and the server decodes: media type -> the file's first bytes.
IMAGE_TYPES: dict[str, tuple[bytes, ...]] = {
    "image/png": (b"\x89PNG\r\n\x1a\n",),
    "image/jpeg": (b"\xff\xd8\xff",),
    "image/webp": (b"RIFF",),  # then 4 bytes of length and "WEBP", checked below
    "image/gif": (b"GIF87a", b"GIF89a"),
    "image/bmp": (b"BM",),
}

# Sampling settings a conversation may keep: name -> (kind, low, high, low inclusive).
# None for any of them means the server's default.
SETTINGS: dict[str, tuple[type, float, float, bool]] = {
    "temperature": (float, 0.0, 2.0, True),
    "top_p": (float, 0.0, 1.0, False),
    "max_tokens": (int, 1, 1 << 20, True),
    "seed": (int, 0, (1 << 63) - 1, True),
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id            TEXT PRIMARY KEY,
    title         TEXT NOT NULL,
    system_prompt TEXT NOT NULL,
    settings      TEXT NOT NULL,      -- JSON object, keys of SETTINGS
    active_leaf   TEXT,               -- id of the last message of the branch on screen
    created       REAL NOT NULL,      -- seconds since the epoch
    updated       REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,   -- insertion order: sibling order
    id              TEXT NOT NULL UNIQUE,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id       TEXT REFERENCES messages(id) ON DELETE CASCADE,
    role            TEXT NOT NULL,
    content         TEXT NOT NULL,
    created         REAL NOT NULL,
    meta            TEXT NOT NULL     -- JSON object: tokens/s, finish reason, stopped, ...
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, seq);
CREATE INDEX IF NOT EXISTS conversations_by_update ON conversations(updated);
-- version 2
CREATE TABLE IF NOT EXISTS message_images (
    message_id TEXT NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    position   INTEGER NOT NULL,  -- 0, 1, ... in the order the message shows them
    media_type TEXT NOT NULL,     -- a key of IMAGE_TYPES
    data       BLOB NOT NULL,     -- the image file's bytes
    PRIMARY KEY (message_id, position)
);
"""


class NotFoundError(LookupError):
    """A conversation or message id that the store does not hold."""


def default_path() -> Path:
    """``$XDG_DATA_HOME/llaisys/conversations.sqlite3``, ``~/.local/share/llaisys/...`` when unset."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "llaisys" / "conversations.sqlite3"


# ---- validation: each raises ValueError / TypeError naming the field and what was expected ----

def _check_str(name: str, value: Any, limit: int) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if len(value) > limit:
        raise ValueError(f"{name} is {len(value)} characters long; at most {limit} are allowed")
    return value


def check_title(value: Any) -> str:
    """A title: a string of at most MAX_TITLE characters, whitespace stripped ('' = untitled)."""
    return " ".join(_check_str("title", value, MAX_TITLE).split())


def check_system_prompt(value: Any) -> str:
    """A system prompt: a string of at most MAX_CONTENT characters ('' = none)."""
    return _check_str("system_prompt", value, MAX_CONTENT)


def check_settings(value: Any) -> dict[str, Any]:
    """Sampling settings: an object with keys of SETTINGS, each a number in its range or null."""
    if not isinstance(value, Mapping):
        raise TypeError(f"settings must be an object, got {type(value).__name__}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key not in SETTINGS:
            raise ValueError(f"unknown setting {key!r}; expected some of {', '.join(SETTINGS)}")
        if v is None:
            continue
        kind, low, high, low_inclusive = SETTINGS[key]
        ok_type = isinstance(v, int) if kind is int else _is_finite(v)
        if isinstance(v, bool) or not ok_type:
            raise TypeError(f"setting {key} must be {'an integer' if kind is int else 'a number'} or null, got "
                            f"{_short(v)}")
        if not (low <= v <= high) or (v == low and not low_inclusive):  # exact for ints of any size
            bracket = "[" if low_inclusive else "("
            raise ValueError(f"setting {key}={_short(v)} is out of range {bracket}{low}, {high}]")
        out[key] = float(v) if kind is float else int(v)
    return out


def clean_settings(value: Any) -> dict[str, Any]:
    """``value`` with the settings check_settings would refuse dropped ({} for a value that is no
    object): how stored settings are read."""
    if not isinstance(value, Mapping):
        return {}
    out: dict[str, Any] = {}
    for key, v in value.items():
        try:
            out.update(check_settings({key: v}))
        except (TypeError, ValueError):
            logger.debug("dropped setting %s = %r", key, v)
    return out


def _is_finite(v: Any) -> bool:
    """Whether ``v`` is a JSON number that is finite (an int of any size, or a finite float)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, int) or math.isfinite(v)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_amount(v: Any) -> bool:
    return _is_finite(v) and v >= 0


def _is_sampling(v: Any) -> bool:
    return isinstance(v, Mapping) and all(isinstance(k, str) and (x is None or _is_finite(x)) for k, x in v.items())


def _is_plain_json(v: Any) -> bool:
    """Whether ``v`` can be written as strict JSON (no NaN or Infinity anywhere in it)."""
    try:
        json.dumps(v, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


# The meta keys the page writes and reads: name -> (test, what is expected). None is allowed for
# each (no value); other keys are kept as they come.
META_FIELDS: dict[str, tuple[Any, str]] = {
    "status": (lambda v: v in STATUSES, f"one of {', '.join(STATUSES)}"),
    "model": (lambda v: isinstance(v, str), "a string"),
    "finish_reason": (lambda v: isinstance(v, str), "a string"),
    "error": (lambda v: isinstance(v, str), "a string"),
    "prompt_tokens": (_is_count, "an integer >= 0"),
    "completion_tokens": (_is_count, "an integer >= 0"),
    "tokens_per_s": (_is_amount, "a number >= 0"),
    "ttft_s": (_is_amount, "a number >= 0"),
    "sampling": (_is_sampling, "an object of numbers"),
    # the answer's reasoning_content: as long as a message may be, so not counted in MAX_META
    "reasoning": (lambda v: isinstance(v, str) and len(v) <= MAX_CONTENT,
                  f"a string of at most {MAX_CONTENT} characters"),
}


def _depth(value: Any) -> int:
    """Levels of lists and dicts in ``value`` (0: a scalar), counted without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, level = todo.pop()
        items = v.values() if isinstance(v, Mapping) else v if isinstance(v, (list, tuple)) else None
        if items is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_META_DEPTH:  # deeper is refused anyway: stop looking
            todo.extend((x, level + 1) for x in items)
    return deepest


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_meta(value: Any, name: str = "meta") -> dict[str, Any]:
    """A message's meta: a JSON object of at most MAX_META characters (``reasoning`` aside),
    nested at most MAX_META_DEPTH levels, whose keys of META_FIELDS hold what they should (or
    None). ``name`` is how errors call it."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be an object, got {type(value).__name__}")
    if _depth(value) > MAX_META_DEPTH:
        raise ValueError(f"{name} nests more than {MAX_META_DEPTH} levels deep")
    for key, v in value.items():
        if not isinstance(key, str):
            raise TypeError(f"{name} keys must be strings, got {key!r}")
        test, expected = META_FIELDS.get(key, (None, ""))
        if test is not None and v is not None and not test(v):
            raise TypeError(f"{name}.{key} must be {expected} or null, got {_short(v)}")
    try:
        text = json.dumps({k: v for k, v in value.items() if k != "reasoning"}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} is not plain JSON: {exc}") from None
    if len(text) > MAX_META:
        raise ValueError(f"{name} is {len(text)} characters of JSON; at most {MAX_META} are allowed")
    return dict(value)


def clean_meta(value: Any) -> dict[str, Any]:
    """``value`` with the keys of META_FIELDS that hold something else, and the other keys whose
    value is not plain JSON (a NaN), dropped ({} for a value that is no object): how a stored
    meta is read, so rows written before these checks (or by hand) never reach the page with a
    wrong type, nor make the conversation unreadable."""
    if not isinstance(value, Mapping):
        return {}
    out = {}
    for key, v in value.items():
        test = META_FIELDS.get(key, (None, ""))[0]
        if v is None or (test(v) if test is not None else _is_plain_json(v)):
            out[key] = v
        else:
            logger.debug("dropped meta.%s = %r: not %s", key, v, META_FIELDS[key][1] if test else "plain JSON")
    return out


def read_json(text: Any, what: str) -> Any:
    """The JSON value stored in a column (None when it is not JSON: written by hand, or damaged)."""
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError):
        logger.debug("%s is not JSON (%.60r): read as empty", what, text)
        return None


def check_seconds(name: str, value: Any, default: float) -> float:
    """A time in seconds since the epoch: a finite number (``default`` for None)."""
    if value is None:
        return default
    if not _is_finite(value):
        raise TypeError(f"{name} must be a number of seconds since the epoch, got {_short(value)}")
    if not 0 <= value < 1e11:  # before the year 5138: a float keeps its milliseconds
        raise ValueError(f"{name} must be in [0, 1e11) seconds since the epoch, got {_short(value)}")
    return float(value)


def _read_seconds(value: Any) -> float | None:
    """A stored time as the API shows it (None for one JSON cannot carry: written by hand)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def check_role(value: Any) -> str:
    """A message role: 'user' or 'assistant' (the system prompt belongs to the conversation)."""
    if value not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {value!r}")
    return value


def check_content(value: Any) -> str:
    """A message's text: a string of at most MAX_CONTENT characters."""
    return _check_str("content", value, MAX_CONTENT)


def image_type(data: bytes) -> str | None:
    """The media type of IMAGE_TYPES whose signature ``data`` starts with (None: none of them)."""
    for media_type, signatures in IMAGE_TYPES.items():
        if data.startswith(signatures) and (media_type != "image/webp" or data[8:12] == b"WEBP"):
            return media_type
    return None


def check_images(value: Any, name: str = "images") -> list[tuple[str, bytes]]:
    """A message's images: a list of at most MAX_IMAGES objects ``{"url": "data:image/<type>;base64,
    <payload>"}`` (None: none), each a PNG, JPEG, WebP, GIF or BMP file of at most MAX_IMAGE_BYTES.
    Returns (media type, file bytes) for each, the type read from the bytes."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of {{\"url\": \"data:image/...\"}} objects, got "
                        f"{type(value).__name__}")
    if len(value) > MAX_IMAGES:
        raise ValueError(f"{name} holds {len(value)} images; a message may carry at most {MAX_IMAGES}")
    out = []
    for k, item in enumerate(value):
        if not isinstance(item, Mapping) or set(item) != {"url"}:
            raise TypeError(f"{name}[{k}] must be an object with only a 'url' (a data URL), got {_short(item)}")
        try:
            data = parse_data_url(item["url"], ImageLimits(max_bytes=MAX_IMAGE_BYTES))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}[{k}].url: {exc}") from None
        media_type = image_type(data)
        if media_type is None:
            raise ValueError(f"{name}[{k}] is not a PNG, JPEG, WebP, GIF or BMP image (its first bytes are "
                             f"{data[:8]!r})")
        out.append((media_type, data))
    return out


def image_url(media_type: str, data: bytes) -> dict[str, str]:
    """A stored image as the API shows it: ``{"url": "data:<media type>;base64,<payload>"}``."""
    return {"url": f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"}


def _user_images(role: str, images: Any, name: str) -> list[tuple[str, bytes]]:
    """check_images for a message of ``role``: only a user message carries images."""
    pictures = check_images(images, name)
    if pictures and role != "user":
        raise ValueError(f"{name}: only a user message carries images, not a(n) {role} message")
    return pictures


def check_id(name: str, value: Any, nullable: bool = True) -> str | None:
    """A message or conversation id: a non-empty string (or None where ``nullable``)."""
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not value or len(value) > 100:
        raise TypeError(f"{name} must be an id string{' or null' if nullable else ''}, got {value!r}")
    return value


def _new_id() -> str:
    return uuid.uuid4().hex


def _auto_title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= AUTO_TITLE else line[: AUTO_TITLE - 1].rstrip() + "\u2026"


def _like(text: str) -> str:
    """``text`` as a LIKE pattern that matches it anywhere (wildcards in it escaped with \\)."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _snippet(content: str, query: str, width: int = 80) -> str:
    at = content.lower().find(query.lower())
    if at < 0:
        return content[:width]
    start = max(0, at - width // 3)
    text = " ".join(content[start: start + width].split())
    return ("\u2026" if start else "") + text + ("\u2026" if start + width < len(content) else "")


class ConversationStore:
    """Conversations and their message trees in one SQLite file (``path``; None: default_path()).

    Methods return plain dicts ready for JSON; bad input raises ValueError/TypeError, an unknown
    id NotFoundError. Safe to call from any thread.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = None

    # ---- connection ----

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            if str(self.path) != ":memory:":
                self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(str(self.path), timeout=10.0, isolation_level=None, check_same_thread=False)
            try:
                db.row_factory = sqlite3.Row
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise ValueError(f"{self.path} holds conversations of schema version {version}; this "
                                     f"llaisys reads version {SCHEMA_VERSION} (upgrade llaisys or pick another --db)")
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA foreign_keys=ON")
                db.execute("PRAGMA synchronous=NORMAL")
                db.executescript(_SCHEMA)
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            except BaseException:
                db.close()
                raise
            logger.info("conversations in %s", self.path)
            self._db = db
        return self._db

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._connect()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def close(self) -> None:
        """Close the database (it opens again on next use)."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # ---- rows to dicts ----

    @staticmethod
    def _message(row: sqlite3.Row, images: Sequence[dict[str, str]] = ()) -> dict[str, Any]:
        return {"id": row["id"], "conversation_id": row["conversation_id"], "parent_id": row["parent_id"],
                "role": row["role"], "content": row["content"], "images": list(images),
                "created": _read_seconds(row["created"]),
                "meta": clean_meta(read_json(row["meta"], f"the meta of message {row['id']}"))}

    @staticmethod
    def _images(db: sqlite3.Connection, cid: str, mid: str | None = None) -> dict[str, list[dict[str, str]]]:
        """The images of the messages of conversation ``cid`` (of message ``mid`` only, when
        given) as the API shows them, in order, by message id. A row of another type (written by
        hand) is left out."""
        if mid is None:
            rows = db.execute("SELECT i.message_id, i.media_type, i.data FROM message_images i JOIN messages m "
                              "ON m.id = i.message_id WHERE m.conversation_id = ? ORDER BY i.message_id, i.position",
                              (cid,))
        else:
            rows = db.execute("SELECT message_id, media_type, data FROM message_images WHERE message_id = ? "
                              "ORDER BY position", (mid,))
        out: dict[str, list[dict[str, str]]] = {}
        for r in rows:
            if isinstance(r["data"], bytes) and r["media_type"] in IMAGE_TYPES:
                out.setdefault(r["message_id"], []).append(image_url(r["media_type"], r["data"]))
            else:
                logger.debug("dropped an image of message %s: a %s of type %r", r["message_id"],
                             type(r["data"]).__name__, r["media_type"])
        return out

    @staticmethod
    def _add_images(db: sqlite3.Connection, mid: str, images: Sequence[tuple[str, bytes]]) -> None:
        db.executemany("INSERT INTO message_images (message_id, position, media_type, data) VALUES (?, ?, ?, ?)",
                       [(mid, k, media_type, data) for k, (media_type, data) in enumerate(images)])

    def _stored_message(self, db: sqlite3.Connection, cid: str, mid: str) -> dict[str, Any]:
        return self._message(self._message_row(db, cid, mid), self._images(db, cid, mid).get(mid, ()))

    @staticmethod
    def _summary(row: sqlite3.Row) -> dict[str, Any]:
        return {"id": row["id"], "title": row["title"], "created": _read_seconds(row["created"]),
                "updated": _read_seconds(row["updated"])}

    def _conversation_row(self, db: sqlite3.Connection, cid: str) -> sqlite3.Row:
        row = db.execute("SELECT * FROM conversations WHERE id = ?", (cid,)).fetchone()
        if row is None:
            raise NotFoundError(f"no conversation {cid!r}")
        return row

    def _message_row(self, db: sqlite3.Connection, cid: str, mid: str) -> sqlite3.Row:
        row = db.execute("SELECT * FROM messages WHERE id = ? AND conversation_id = ?", (mid, cid)).fetchone()
        if row is None:
            raise NotFoundError(f"no message {mid!r} in conversation {cid!r}")
        return row

    def _full(self, db: sqlite3.Connection, cid: str) -> dict[str, Any]:
        row = self._conversation_row(db, cid)
        images = self._images(db, cid)
        messages = [self._message(m, images.get(m["id"], ())) for m in
                    db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY seq", (cid,))]
        parent = {m["id"]: m["parent_id"] for m in messages}
        path: list[str] = []
        node = row["active_leaf"]
        while node is not None and node in parent and len(path) <= len(parent):
            path.append(node)
            node = parent[node]
        path.reverse()
        return {**self._summary(row), "system_prompt": row["system_prompt"],
                "settings": clean_settings(read_json(row["settings"], f"the settings of conversation {cid}")),
                "active_leaf": row["active_leaf"],
                "messages": messages, "path": path}

    # ---- conversations ----

    def list_conversations(self, q: str = "", limit: int = 500) -> list[dict[str, Any]]:
        """Summaries (id, title, created, updated), most recently updated first; with ``q``, only
        those whose title or any message contains it (case-insensitive for ASCII letters), each
        with a ``snippet`` of the first matching message."""
        q = _check_str("q", q, 1000).strip()
        with self._lock:
            db = self._connect()
            if not q:
                rows = db.execute("SELECT * FROM conversations ORDER BY updated DESC, rowid DESC LIMIT ?",
                                  (limit,)).fetchall()
                return [self._summary(r) for r in rows]
            pattern = _like(q)
            rows = db.execute(
                "SELECT * FROM conversations c WHERE c.title LIKE ?1 ESCAPE '\\' OR EXISTS ("
                " SELECT 1 FROM messages m WHERE m.conversation_id = c.id AND m.content LIKE ?1 ESCAPE '\\')"
                " ORDER BY updated DESC, rowid DESC LIMIT ?2", (pattern, limit)).fetchall()
            out = []
            for r in rows:
                hit = db.execute("SELECT content FROM messages WHERE conversation_id = ? AND content LIKE ? "
                                 "ESCAPE '\\' ORDER BY seq LIMIT 1", (r["id"], pattern)).fetchone()
                out.append({**self._summary(r), "snippet": _snippet(hit["content"], q) if hit else ""})
            return out

    def create_conversation(self, title: str = "", system_prompt: str = "",
                            settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A new empty conversation (an empty title is replaced by the first user message's start)."""
        title, system_prompt = check_title(title), check_system_prompt(system_prompt)
        settings = check_settings(settings or {})
        cid, now = _new_id(), time.time()
        with self._transaction() as db:
            db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, NULL, ?, ?)",
                       (cid, title, system_prompt, json.dumps(settings), now, now))
            return self._full(db, cid)

    def get_conversation(self, cid: str) -> dict[str, Any]:
        """The conversation with all its messages (insertion order) and ``path``: the ids from the
        first message to ``active_leaf``."""
        with self._lock:
            return self._full(self._connect(), cid)

    def update_conversation(self, cid: str, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Change some of title, system_prompt, settings (replaced whole) and active_leaf (a message
        of this conversation, or None); returns the conversation."""
        checks = {"title": check_title, "system_prompt": check_system_prompt,
                  "settings": lambda v: json.dumps(check_settings(v)),
                  "active_leaf": lambda v: check_id("active_leaf", v)}
        unknown = set(changes) - set(checks)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}; expected some of {', '.join(checks)}")
        values = {key: checks[key](v) for key, v in changes.items()}
        with self._transaction() as db:
            self._conversation_row(db, cid)
            if values.get("active_leaf") is not None:
                self._message_row(db, cid, values["active_leaf"])
            for key, v in values.items():  # keys are from ``checks``, never user text
                db.execute(f"UPDATE conversations SET {key} = ? WHERE id = ?", (v, cid))
            if set(values) - {"active_leaf"}:  # switching branches does not move a chat up the list
                db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), cid))
            return self._full(db, cid)

    def delete_conversation(self, cid: str) -> None:
        """Delete the conversation and all its messages."""
        with self._transaction() as db:
            self._conversation_row(db, cid)
            db.execute("DELETE FROM conversations WHERE id = ?", (cid,))

    # ---- messages ----

    def add_message(self, cid: str, role: str, content: str, parent_id: str | None = None,
                    meta: Mapping[str, Any] | None = None, activate: bool = True,
                    images: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """Add a message under ``parent_id`` (None: a first message); with ``activate`` it becomes
        the conversation's active leaf. The first user message of an untitled conversation titles it.
        A user message may carry ``images`` (see check_images); they cannot change afterwards."""
        role, content = check_role(role), check_content(content)
        parent_id = check_id("parent_id", parent_id)
        meta = check_meta(meta or {})
        pictures = _user_images(role, images, "images")
        if not isinstance(activate, bool):
            raise TypeError(f"activate must be true or false, got {activate!r}")
        mid, now = _new_id(), time.time()
        with self._transaction() as db:
            conv = self._conversation_row(db, cid)
            if parent_id is not None:
                self._message_row(db, cid, parent_id)
            db.execute("INSERT INTO messages (id, conversation_id, parent_id, role, content, created, meta) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)", (mid, cid, parent_id, role, content, now, json.dumps(meta)))
            self._add_images(db, mid, pictures)
            title = _auto_title(content) if conv["title"] == "" and role == "user" else conv["title"]
            leaf = mid if activate else conv["active_leaf"]
            db.execute("UPDATE conversations SET title = ?, active_leaf = ?, updated = ? WHERE id = ?",
                       (title, leaf, now, cid))
            return self._stored_message(db, cid, mid)

    def update_message(self, cid: str, mid: str, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Replace a message's ``content`` and/or merge ``meta`` into its meta (a key set to None is
        removed): how a streamed answer is saved as it grows."""
        unknown = set(changes) - {"content", "meta"}
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}; expected content and/or meta")
        content = check_content(changes["content"]) if "content" in changes else None
        patch = check_meta(changes["meta"]) if "meta" in changes else {}
        with self._transaction() as db:
            row = self._message_row(db, cid, mid)
            meta = clean_meta(read_json(row["meta"], f"the meta of message {mid}"))
            meta.update(patch)
            meta = check_meta({k: v for k, v in meta.items() if v is not None})
            db.execute("UPDATE messages SET content = ?, meta = ? WHERE id = ?",
                       (row["content"] if content is None else content, json.dumps(meta), mid))
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), cid))
            return self._stored_message(db, cid, mid)

    # ---- export / import ----

    def export_conversation(self, cid: str) -> dict[str, Any]:
        """A self-contained JSON document of the conversation, which import_conversations reads.
        Its ``version`` is the oldest schema that holds it all: 1 without images, so an older
        llaisys imports it."""
        conv = self.get_conversation(cid)
        body = {k: conv[k] for k in ("title", "system_prompt", "settings", "created", "updated", "active_leaf")}
        body["messages"] = []
        for m in conv["messages"]:
            item = {k: m[k] for k in ("id", "parent_id", "role", "content", "created", "meta")}
            if m["images"]:
                item["images"] = m["images"]
            body["messages"].append(item)
        version = 2 if any("images" in m for m in body["messages"]) else 1
        return {"format": EXPORT_FORMAT, "version": version, "exported": time.time(), "conversation": body}

    def import_conversations(self, document: Any) -> list[dict[str, Any]]:
        """Add the conversation(s) of an exported document (``conversation``: one; ``conversations``:
        a list) as new conversations with new ids; returns their summaries. All or nothing."""
        if not isinstance(document, Mapping):
            raise TypeError(f"an import must be a JSON object, got {type(document).__name__}")
        if document.get("format", EXPORT_FORMAT) != EXPORT_FORMAT:
            raise ValueError(f"format must be {EXPORT_FORMAT!r}, got {document.get('format')!r}")
        if not isinstance(document.get("version", 1), int) or document.get("version", 1) > SCHEMA_VERSION:
            raise ValueError(f"version {_short(document.get('version'))} is not one this llaisys reads "
                             f"(at most {SCHEMA_VERSION})")
        if "conversation" in document:
            items = [document["conversation"]]
        elif isinstance(document.get("conversations"), list):
            items = document["conversations"]
        else:
            raise ValueError("an import needs a 'conversation' object or a 'conversations' list")
        plans = [self._plan_import(i, item) for i, item in enumerate(items)]
        ids = []
        with self._transaction() as db:
            for conv, messages, leaf in plans:
                cid, now = _new_id(), time.time()
                new_id = {m["id"]: _new_id() for m in messages}
                db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (cid, conv["title"], conv["system_prompt"], json.dumps(conv["settings"]),
                            new_id.get(leaf), conv["created"], now))
                db.executemany("INSERT INTO messages (id, conversation_id, parent_id, role, content, created, meta) "
                               "VALUES (?, ?, ?, ?, ?, ?, ?)",
                               [(new_id[m["id"]], cid, new_id.get(m["parent_id"]), m["role"], m["content"],
                                 m["created"], json.dumps(m["meta"])) for m in messages])
                for m in messages:
                    if m["images"]:
                        self._add_images(db, new_id[m["id"]], m["images"])
                ids.append(cid)
            return [self._summary(self._conversation_row(db, cid)) for cid in ids]

    @staticmethod
    def _plan_import(index: int, item: Any) -> tuple[dict[str, Any], list[dict[str, Any]], str | None]:
        """Check one exported conversation; returns it, its messages parents first, and its leaf."""
        where = f"conversations[{index}]"
        try:
            if not isinstance(item, Mapping):
                raise TypeError(f"must be an object, got {type(item).__name__}")
            now = time.time()
            conv = {"title": check_title(item.get("title", "")),
                    "system_prompt": check_system_prompt(item.get("system_prompt", "")),
                    "settings": check_settings(item.get("settings") or {}),
                    "created": check_seconds("created", item.get("created"), now)}
            raw = item.get("messages", [])
            if not isinstance(raw, list):
                raise TypeError(f"messages must be a list, got {type(raw).__name__}")
            messages, depth = [], {}
            for j, m in enumerate(raw):
                if not isinstance(m, Mapping):
                    raise TypeError(f"messages[{j}] must be an object, got {type(m).__name__}")
                msg = {"id": check_id(f"messages[{j}].id", m.get("id"), nullable=False),
                       "parent_id": check_id(f"messages[{j}].parent_id", m.get("parent_id")),
                       "role": check_role(m.get("role")), "content": check_content(m.get("content")),
                       "meta": check_meta(m.get("meta") or {}, f"messages[{j}].meta"),
                       "created": check_seconds(f"messages[{j}].created", m.get("created"), now)}
                msg["images"] = _user_images(msg["role"], m.get("images"), f"messages[{j}].images")
                if msg["id"] in depth:
                    raise ValueError(f"message id {msg['id']!r} appears twice")
                depth[msg["id"]] = None
                messages.append(msg)
            parent = {m["id"]: m["parent_id"] for m in messages}
            for m in messages:  # depth of each message; a parent outside the list or a cycle is an error
                chain, on_chain, node = [], set(), m["id"]  # each message joins one chain: linear in all
                while node is not None and depth[node] is None:
                    if node in on_chain:
                        raise ValueError(f"messages form a cycle through {node!r}")
                    chain.append(node)
                    on_chain.add(node)
                    node = parent[node]
                    if node is not None and node not in parent:
                        raise ValueError(f"message {chain[-1]!r} names a parent {node!r} that is not in the list")
                base = -1 if node is None else depth[node]
                for k, name in enumerate(reversed(chain)):
                    depth[name] = base + 1 + k
            leaf = item.get("active_leaf", messages[-1]["id"] if messages else None)
            if leaf is not None and leaf not in parent:
                raise ValueError(f"active_leaf {leaf!r} is not one of the messages")
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
        order = sorted(range(len(messages)), key=lambda j: (depth[messages[j]["id"]], j))  # parents first
        return conv, [messages[j] for j in order], leaf
