"""POST /v1/embeddings: each input (tokenized and checked by ``requests.build_request``)
prefilled through the embedding engine (batched, nothing generated), its final hidden states
pooled (the last token's, or the mean over its tokens) and L2-normalized, returned as floats or
base64 (little-endian float32, as OpenAI sends them)."""
from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from ..engine import AsyncRequestStream, EngineStopped
from .bodies import render_json
from .completions import until_disconnected
from .errors import APIError, shutting_down
from .protocol import EmbeddingRequest
from .requests import build_request
from .service import ModelService


def encode(vec: np.ndarray, encoding_format: str) -> list[float] | str:
    """An embedding (D,) as OpenAI sends it: a list of floats, or base64 of float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.astype(np.float32).tolist()


async def _embedding(stream: AsyncRequestStream) -> tuple[np.ndarray, int]:
    """The embedding of one request and its prompt's token count."""
    async for out in stream:
        if out.finished:
            if out.finish_reason == "abort" or out.embedding is None:
                raise shutting_down()
            return out.embedding, out.prompt_tokens
    raise shutting_down()


async def create_embeddings(service: ModelService, req: EmbeddingRequest, request: Request) -> Response:
    """Answer POST /v1/embeddings."""
    built = await build_request(service, req)  # prompt ids and a PoolingConfig per input
    response_id = f"embd-{uuid.uuid4().hex}"
    streams: list[AsyncRequestStream] = []
    try:
        for job in built.jobs:
            streams.append(await service.submit_embedding(f"{response_id}-{job.index}", job.prompt_ids, job.config))

        async def gather() -> list[tuple[np.ndarray, int]]:
            try:
                return await asyncio.gather(*(_embedding(s) for s in streams))
            except EngineStopped:
                raise APIError(503, "the embedding engine stopped", code="engine_unavailable") from None

        results = await until_disconnected(request.receive, gather())
    finally:
        service.release_embeddings(streams)
    if results is None:  # the client left
        return Response(status_code=499)

    def render() -> bytes:  # worker thread: many long vectors take a while to write as JSON
        tokens = sum(n for _, n in results)
        data: list[dict[str, Any]] = [{"object": "embedding", "index": i,
                                       "embedding": encode(vec, req.encoding_format)}
                                      for i, (vec, _) in enumerate(results)]
        return render_json({"object": "list", "data": data, "model": service.model_name,
                            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    return Response(await service.in_worker(render), media_type="application/json")
