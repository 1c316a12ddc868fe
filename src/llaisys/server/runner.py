"""Running the app under uvicorn, with a graceful shutdown.

On SIGINT or SIGTERM uvicorn stops accepting connections and waits for the open ones; we also
refuse new requests on connections still open, give the running ones
``options.shutdown_timeout_s`` to finish, then end them (a stream gets a last error event
saying the server is shutting down, a waiting client a 503), and the engine thread stops
when the app does. A second Ctrl-C quits at once.
"""
from __future__ import annotations

import logging
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from .options import ServerOptions
from .service import ModelService

log = logging.getLogger(__name__)


class Server(uvicorn.Server):
    """uvicorn's server, draining the model service's requests on exit."""

    def __init__(self, config: uvicorn.Config, service: ModelService, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.service = service
        self.shutdown_timeout_s = shutdown_timeout_s
        service.on_load_failed = lambda exc: setattr(self, "should_exit", True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal (or a call from any thread): start the graceful shutdown."""
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            log.info("shutting down: running requests have %.0f s to finish", self.shutdown_timeout_s)
            self.service.begin_drain(self.shutdown_timeout_s)


def make_server(app: FastAPI, options: ServerOptions, *, log_level: str = "info", access_log: bool = True) -> Server:
    """A Server for ``app`` on ``options.host``:``options.port`` (not started)."""
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=options.shutdown_timeout_s + 5.0, lifespan="on")
    return Server(config, app.state.service, options.shutdown_timeout_s)


def serve(app: FastAPI, options: ServerOptions, sock: socket.socket | None = None) -> int:
    """Serve until SIGINT/SIGTERM; 0, or 1 when the model failed to load."""
    server = make_server(app, options)
    server.run(sockets=[sock] if sock is not None else None)
    return 1 if app.state.service.error is not None else 0

