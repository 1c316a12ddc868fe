"""``llaisys serve``: an OpenAI-compatible HTTP server over the serving engine.

    from llaisys.server import ServerOptions, create_app, serve
    app = create_app(ServerOptions(port=8000))   # the bundled model, loaded in the background
    serve(app, app.state.service.options)

FastAPI on uvicorn; the engine runs in its own thread (``EngineThread``) fed through its queue.
Routes: /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/embeddings,
/v1/models, /tokenize, /detokenize, /health, /metrics (Prometheus, vLLM's names), /version,
and the chat UI at /. See docs/server.md.

A request goes ``app`` (its route) → its protocol module (``completions``, ``responses``,
``anthropic``, ``embeddings``: the API's shapes) → ``requests.build_request`` (prompt ids and a
config per choice) → ``service.ModelService.submit`` (the model's lifecycle and engine threads)
→ the engine thread.
"""
from .app import create_app
from .errors import APIError
from .options import ServerOptions
from .runner import Server, make_server, serve
from .service import ModelService

__all__ = ["APIError", "ModelService", "Server", "ServerOptions", "create_app", "make_server", "serve"]
