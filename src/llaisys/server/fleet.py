"""The models one server serves: one ``ModelService`` each, loaded on demand and unloaded to
make room, as ollama and llama-server's router mode do.

A server of one model (``--model PATH`` or none) loads it at start and keeps it: requests
naming another model get 404. A server of several (``--model A --model B``, ``--models-dir``)
knows them by name: those given, those in the folder (rescanned when a request names one it
does not know) and those ``llaisys list`` finds (the bundled model, the Hugging Face cache,
ollama's store; only by their listed names, never by a path a client sends). A request's
``model`` picks one; the first request to a model that is not loaded loads it, and every
request arriving meanwhile waits for that same load (at most ``load_timeout_s``, then 503).
A model that fails to load answers 503 with the reason to its own requests only, and is tried
again on a request after ``RETRY_FAILED_S``.

Room: at most ``max_models`` loaded, holding at most ``models_memory_bytes`` together (a
model's size is what it took when last loaded, its weights and KV pools; before its first load,
its files' size). To load one more, the least recently used idle model is unloaded, then the
next, until it fits; a model with requests running (its ``leases``, counted from the request's
arrival to its response's end by ``middleware.ModelLeases``) or pinned is never unloaded; when only busy
ones are left, the load waits for one to become idle. After the load the actual size is
checked again. ``idle_unload_s``: a model unused this long is unloaded.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from starlette.types import Scope

from ..models.discovery import later_split_part
from .errors import APIError, shutting_down
from .metrics import MetricFamilies
from .middleware import LEASES
from .options import ServerOptions
from .service import ModelService, default_model_name

log = logging.getLogger(__name__)

RETRY_FAILED_S = 30.0  # a model that failed to load is tried again by a request after this long
RESCAN_S = 5.0  # `llaisys list`'s places are looked at again at most this often
WAIT_POLL_S = 0.05  # how often a load waiting for room looks again


def machine_memory() -> int | None:
    """Bytes of physical memory (None: unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def source_bytes(source: str) -> int:
    """The size of a model's files: a .gguf file (and the mmproj beside it), or a folder's
    weights (.safetensors, .gguf, .bin); 0 when unknown (a name not yet resolved)."""
    path = Path(source)
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(f.stat().st_size for f in path.iterdir()
                       if f.suffix in (".safetensors", ".gguf", ".bin") and f.is_file())
    except OSError:
        pass
    return 0


def folder_models(folder: str) -> dict[str, str]:
    """The models in ``folder`` by name: each ``NAME.gguf`` (not an ``mmproj``, only the first
    part of a split file), each sub-folder holding a config.json or .gguf files (NAME: the
    sub-folder's). Unreadable entries are skipped."""
    found: dict[str, str] = {}
    try:
        entries = sorted(Path(folder).iterdir())
    except OSError as exc:
        log.warning("--models-dir %s: %s", folder, exc.strerror or exc)
        return found
    for entry in entries:
        name = entry.stem if entry.suffix.lower() == ".gguf" else entry.name
        try:
            if entry.is_file() and entry.suffix.lower() == ".gguf":
                if entry.name.lower().startswith("mmproj") or later_split_part(entry):
                    continue
                found.setdefault(name, str(entry))
            elif entry.is_dir() and not entry.name.startswith("."):
                ggufs = sorted(f for f in entry.iterdir() if f.suffix.lower() == ".gguf"
                               and not f.name.lower().startswith("mmproj"))
                if (entry / "config.json").is_file():
                    found.setdefault(name, str(entry))
                elif ggufs:
                    found.setdefault(name, str(ggufs[0]))
        except OSError:
            continue
    return found


def listed_models() -> dict[str, str]:
    """The models ``llaisys list`` shows, by the names it shows them under."""
    from ..models.discovery import find_models

    try:
        return {found.name: str(found.path) for found in find_models()}
    except (OSError, ValueError) as exc:
        log.warning("looking for models by name failed: %s", exc)
        return {}


class ModelFleet:
    """The server's models by name (``services``), the default one (``default``, None when a
    request must name one), and the rules that load and unload them (see the module)."""

    def __init__(self, options: ServerOptions, model: Any = None, loader: Callable[[], Any] | None = None,
                 load_source: Callable[[str], Any] | None = None) -> None:
        self.options = options
        self.families = MetricFamilies()
        self.load_source = load_source
        self.services: dict[str, ModelService] = {}
        self.sources: dict[str, str] = {}
        self.draining = False
        self.ending = asyncio.Event()  # set when the running requests are ended (shutdown)
        self._lock: asyncio.Lock | None = None  # one load (with the room it makes) at a time
        self._loads: dict[str, asyncio.Future] = {}
        self._scanned = 0.0
        self._reaper: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if options.many_models:
            for name, source in options.models:
                self._add(name, source)
            self._rescan(force=True)
            self.default = self.services[options.models[0][0]] if options.models else None
            unknown = [name for name in options.pinned if name not in self.services]
            if unknown:
                raise ValueError(f"pinned model {unknown[0]!r} is not served; the models: {', '.join(self.services)}")
            for name in options.pinned:
                self.services[name].pinned = True
        else:
            name = default_model_name(options, model)
            service = ModelService(options, model, loader, name=name, metrics=self._metrics(name), pinned=True)
            self.services[service.model_name] = service
            self.default = service

    # ---- the catalogue -----------------------------------------------------------------
    def _metrics(self, name: str) -> Any:
        from .metrics import Metrics

        return Metrics(name, self.families)

    def _add(self, name: str, source: str) -> ModelService:
        options = replace(self.options, model=source, served_model_name=name, models=(), models_dir=None)
        load = self.load_source
        loader = (lambda: load(source)) if load is not None else None
        service = ModelService(options, None, loader, name=name, metrics=self._metrics(name))
        if self._loop is not None:
            service.attach(self._loop)
        self.services[name] = service
        self.sources[name] = source
        return service

    def _rescan(self, force: bool = False) -> None:
        """Add the models of ``models_dir`` (one listing: looked at each time) and of ``llaisys
        list`` (the caches' walk: at most every RESCAN_S) not known yet."""
        found = folder_models(self.options.models_dir) if self.options.models_dir is not None else {}
        now = time.monotonic()
        if force or now - self._scanned >= RESCAN_S:
            self._scanned = now
            served = set(self.sources.values()) | {os.path.realpath(s) for s in self.sources.values()}
            listed = {name: path for name, path in listed_models().items()  # not again under a second name
                      if name not in served and os.path.realpath(path) not in served}
            found = {**listed, **found}
        for name, source in found.items():
            if name not in self.services:
                self._add(name, source)

    def lookup(self, name: str | None) -> ModelService:
        """The service of the model named ``name`` (None: the default). APIError 404 for a
        name not served (listing those that are), 400 when several are served and none named."""
        if not self.options.many_models:
            return self.default  # acquire() checks the name, once the model is ready (503 comes first)
        if name is None:
            if self.default is not None:
                return self.default
            raise APIError(400, f"this server serves several models: name one in `model` ({self.names()})",
                           param="model", code="model_required")
        service = self.services.get(name)
        if service is None:  # a model copied into the folder since, or newly in a cache
            self._rescan()
            service = self.services.get(name)
        if service is None:
            raise APIError(404, f"The model `{name}` does not exist; this server serves {self.names()}.",
                           param="model", code="model_not_found")
        return service

    def names(self) -> str:
        """The served models' names, quoted, for messages (the first 20)."""
        names = list(self.services)
        shown = ", ".join(f"`{n}`" for n in names[:20])
        return shown + (f" and {len(names) - 20} more" if len(names) > 20 else "")

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """At the app's start: the single model (or the pinned ones) start loading."""
        self._loop = loop
        self._lock = asyncio.Lock()
        self.ending = asyncio.Event()  # one of this loop's
        for service in self.services.values():
            service.attach(loop)
        if not self.options.many_models:
            self.default.start(loop)
            return
        for name in self.options.pinned:
            self._loads[name] = asyncio.ensure_future(self._load(self.services[name]))
        if self.options.idle_unload_s is not None:
            self._reaper = asyncio.ensure_future(self._unload_idle(self.options.idle_unload_s))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every model's engine threads and workers (the app's end; any thread)."""
        if self._reaper is not None:
            self._reaper.cancel()
        for service in self.services.values():
            service.stop(timeout)

    @property
    def error(self) -> BaseException | None:
        """The single model's load failure (a server of several runs on without a model)."""
        return None if self.options.many_models else self.default.error

    @property
    def on_load_failed(self) -> Callable[[BaseException], None] | None:
        return self.default.on_load_failed if self.default is not None else None

    @on_load_failed.setter
    def on_load_failed(self, callback: Callable[[BaseException], None] | None) -> None:
        """Called when the single model fails to load (the server then exits); a server of
        several keeps serving the others."""
        if not self.options.many_models:
            self.default.on_load_failed = callback

    def begin_drain(self, timeout: float) -> None:
        """Refuse new requests; after ``timeout`` s abort those still running (any thread)."""
        self.draining = True
        for service in self.services.values():
            service.begin_drain(timeout)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.call_later, timeout, self.ending.set)

    def end_now(self) -> None:
        """Refuse new requests and abort the running ones now (any thread)."""
        self.draining = True
        for service in self.services.values():
            service.end_now()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.ending.set)

    # ---- requests ----------------------------------------------------------------------
    async def acquire(self, scope: Scope, name: str | None) -> ModelService:
        """The service of ``name``, loaded (loading it, or waiting for its load), leased to the
        request of ``scope`` until its response ends (``middleware.ModelLeases``). APIError: 404/400 from
        ``lookup``, 503 when it cannot load in time, failed, or the server is shutting down."""
        service = self.lookup(name)
        if not self.options.many_models:
            service.require_ready()
            service.check_model(name)
        service.leases += 1
        scope.setdefault(LEASES, []).append(service)
        service.last_used = time.monotonic()
        await self.ensure_loaded(service)
        return service

    async def ensure_loaded(self, service: ModelService) -> None:
        """Return once ``service`` is ready; start its load unless one runs. APIError 503 on
        timeout, failure or shutdown."""
        if service.status == "ready" or not self.options.many_models:
            return
        if self.draining:
            raise shutting_down()
        if service.status == "failed" and time.monotonic() - service.failed_at < RETRY_FAILED_S:
            service.require_ready()
        load = self._loads.get(service.model_name)
        if load is None or load.done():
            load = self._loads[service.model_name] = asyncio.ensure_future(self._load(service))
        timeout = self.options.load_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(load), timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"the model `{service.model_name}` is still loading after {timeout:g} s; try again "
                           "shortly", code="model_loading") from None
        service.require_ready()

    async def _load(self, service: ModelService) -> None:
        """Make room for ``service``, load it, then check the room with its actual size. An
        APIError (no room in time) goes to every request waiting for this load."""
        assert self._lock is not None
        async with self._lock:
            await service.settled()  # an unload under way ends first
            if service.status == "ready":
                return
            need = service.loaded_bytes or source_bytes(self.sources.get(service.model_name, ""))
            await self._make_room(service, need)
            service.begin_load()
            await service.settled()
            if service.status == "ready":
                await self._make_room(service, 0, waiting=False)

    def _budget(self) -> int | None:
        if self.options.models_memory_bytes is not None:
            return self.options.models_memory_bytes
        memory = machine_memory()
        return int(memory * 0.9) if memory else None

    async def _make_room(self, incoming: ModelService, need: int, waiting: bool = True) -> None:
        """Unload idle models, least recently used first, until ``incoming`` (needing ``need``
        bytes more; 0 when loaded already) fits the count and the memory budget. With
        ``waiting``, wait for busy models to become idle (up to load_timeout_s), else leave it."""
        budget, most = self._budget(), self.options.max_models
        deadline = time.monotonic() + self.options.load_timeout_s
        while True:
            others = [s for s in self.services.values() if s is not incoming and s.status in ("ready", "loading")]
            used = sum(s.memory_bytes() or s.loaded_bytes or 0 for s in others)
            own = incoming.memory_bytes() or need
            too_many = most is not None and len(others) + 1 > most
            too_big = budget is not None and used + own > budget
            if not (too_many or too_big):
                return
            idle = sorted((s for s in others if s.status == "ready" and not s.pinned and s.leases == 0),
                          key=lambda s: s.last_used)
            if idle:
                victim = idle[0]
                why = (f"at most {most} models are loaded" if too_many else
                       f"{incoming.model_name} needs {own / 2**20:.0f} MiB and the others hold {used / 2**20:.0f} MiB "
                       f"of the {budget / 2**20:.0f} MiB budget")
                log.info("unloading %s (least recently used): %s", victim.model_name, why)
                await self._unload(victim)
                continue
            if waiting and others and all(s.pinned for s in others):
                raise APIError(503, f"no room to load `{incoming.model_name}`: the loaded models "
                               f"({', '.join(s.model_name for s in others)}) are pinned; unload one (POST /models/unload)"
                               " or raise --max-models / --models-memory", code="model_capacity")
            if not others or not waiting:
                if too_big:
                    log.warning("%s holds more than the models' memory budget (%.0f MiB) allows with the models "
                                "that are busy or pinned", incoming.model_name, budget / 2**20)
                return
            if time.monotonic() >= deadline:
                busy = ", ".join(s.model_name for s in others)
                raise APIError(503, f"no room to load `{incoming.model_name}`: the loaded models ({busy}) are busy "
                               f"or pinned; try again shortly", code="model_capacity")
            await asyncio.sleep(WAIT_POLL_S)

    async def _unload(self, service: ModelService) -> None:
        service.state = "unloading"
        if service._settled is not None:
            service._settled.clear()
        await asyncio.to_thread(service.unload)

    async def unload(self, name: str) -> ModelService:
        """Unload the model ``name`` now and unpin it (the unload endpoint). APIError 409 while
        requests use it, 400 for the model of a single-model server."""
        service = self.lookup(name)
        if not self.options.many_models or service.loader is None:
            raise APIError(400, f"`{service.model_name}` is this server's only model; it cannot be unloaded",
                           param="model", code="model_not_unloadable")
        await service.settled()
        if service.leases:
            raise APIError(409, f"`{service.model_name}` has {service.leases} request(s) running; unload it when "
                           "they end", param="model", code="model_busy")
        service.pinned = False
        if service.status == "ready":
            await self._unload(service)
        return service

    async def _unload_idle(self, idle_s: float) -> None:
        """Unload the models unused for ``idle_s`` seconds, unless pinned (a task, till the end)."""
        while True:
            await asyncio.sleep(max(min(idle_s / 4, 5.0), 0.05))
            now = time.monotonic()
            for service in list(self.services.values()):
                if (service.status == "ready" and not service.pinned and service.leases == 0
                        and now - service.last_used >= idle_s and not (self._lock and self._lock.locked())):
                    log.info("unloading %s: unused for %.0f s (--idle-unload)", service.model_name, now - service.last_used)
                    await self._unload(service)

    # ---- what the routes show ----------------------------------------------------------
    def describe(self, service: ModelService) -> dict[str, Any]:
        """A model as /v1/models lists it (OpenAI's fields, then ours: its state, whether
        pinned, its memory; when loaded its context and capabilities)."""
        status = service.status
        out: dict[str, Any] = {
            "id": service.model_name, "object": "model", "created": service.created, "owned_by": "llaisys",
            "root": str(getattr(service.model, "source", None) or self.sources.get(service.model_name)
                        or service.options.model or service.model_name),
            "parent": None, "status": {"value": "loaded" if status == "ready" else status},
            "pinned": service.pinned}
        if status == "ready":
            out["max_model_len"] = service.max_model_len
            out["capabilities"] = service.capabilities()
            out["memory_bytes"] = service.memory_bytes()
        elif status == "failed":
            out["status"]["error"] = service.failure()
        return out


def model_name_for(options: ServerOptions, source: str) -> str:
    """The name a model given as ``--model source`` is served under: the file's stem or the folder's name."""
    return default_model_name(replace(options, model=source, served_model_name=None))
