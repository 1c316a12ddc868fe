"""What a gateway in front of several replicas asks a worker about itself: SGLang's
``/server_info`` and ``/model_info`` (and their older ``/get_`` names), which SGLang's model
gateway (``sglang-router``) reads when a worker registers, taking the served model's name for
its ``/v1/models`` and for routing requests by ``model``.

    sglang-router launch --worker-urls http://10.0.0.1:8000 http://10.0.0.2:8000 --policy cache_aware

Both answer behind the API key, as the other API routes do (the gateway sends a worker's key
as a Bearer token).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from .. import __version__


async def _service(request: Request) -> Any:
    """The default model's service (loaded when a server of several has to load it)."""
    return await request.app.state.models.acquire(request.scope, None)


def server_info(service: Any) -> dict[str, Any]:
    """The server's side: the model's name and path, its parallelism and its engine's sizes."""
    service.require_ready()
    opts, model = service.options, service.model
    engine = service.engine.engine
    comm = getattr(model, "comm", None)
    return {
        "served_model_name": service.model_name,
        "model_path": str(getattr(model, "source", service.model_name)),
        "tp_size": int(getattr(comm, "size", 1) or 1),
        "dp_size": 1,
        "version": __version__,
        "max_total_tokens": service.kv_capacity,
        "max_running_requests": opts.max_seqs,
        "max_prefill_tokens": opts.max_batched_tokens,
        "max_model_len": service.max_model_len,
        "page_size": engine.blocks.block_size,
        "prefix_caching": engine.blocks.prefix_caching,
    }


def model_info(service: Any) -> dict[str, Any]:
    """The model's side: where it came from, what it is; ``tokenizer_path`` only for a folder
    holding a ``tokenizer.json`` (a path a gateway could load it from)."""
    service.require_ready()
    model = service.model
    source = str(getattr(model, "source", service.model_name))
    config = getattr(model, "config", None)
    folder = Path(source)
    return {
        "model_path": source,
        "tokenizer_path": source if folder.is_dir() and (folder / "tokenizer.json").is_file() else None,
        "is_generation": True,
        "model_type": getattr(config, "architecture", None),
        "max_model_len": service.max_model_len,
    }


def install(api: APIRouter) -> None:
    """Add the routes to ``api`` (the router behind the API key)."""

    @api.get("/server_info")
    @api.get("/get_server_info", include_in_schema=False)
    async def get_server_info(request: Request) -> dict[str, Any]:
        """SGLang's /server_info: the served model and the engine's sizes."""
        return server_info(await _service(request))

    @api.get("/model_info")
    @api.get("/get_model_info", include_in_schema=False)
    async def get_model_info(request: Request) -> dict[str, Any]:
        """SGLang's /model_info: the model's path and type."""
        return model_info(await _service(request))
