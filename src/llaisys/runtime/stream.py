"""Streams and events of one device, wrapping the backend's opaque handles."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .runtime import Runtime


class Event:
    """A marker in a stream's work; other streams and the host can wait for it."""

    def __init__(self, runtime: "Runtime"):
        self.runtime = runtime
        self.handle: Any = runtime._call("create_event")

    def record(self, stream: "Stream | None" = None) -> None:
        """Complete this event once the work queued so far on ``stream`` is done."""
        self.runtime._call("record_event", _handle(stream), self.handle)

    def query(self) -> bool:
        """True when the event is complete."""
        return bool(self.runtime._call("query_event", self.handle))

    def synchronize(self) -> None:
        """Block the host until the event is complete."""
        self.runtime._call("synchronize_event", self.handle)

    def close(self) -> None:
        """Release the event now rather than at garbage collection."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self.runtime._call("destroy_event", handle)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Stream:
    """An ordered queue of work on one device."""

    def __init__(self, runtime: "Runtime", handle: Any = None, owned: bool = True):
        self.runtime = runtime
        self.handle = handle if handle is not None or not owned else runtime._call("create_stream")
        self._owned = owned

    def synchronize(self) -> None:
        """Block until all work queued on this stream is done."""
        self.runtime._call("synchronize_stream", self.handle)

    def query(self) -> bool:
        """True when all work queued on this stream is done."""
        return bool(self.runtime._call("query_stream", self.handle))

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait until ``event`` is complete."""
        self.runtime._call("stream_wait_event", self.handle, event.handle)

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if omitted) at the current end of this stream."""
        event = event or Event(self.runtime)
        event.record(self)
        return event

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` on the host after the work queued before it."""
        self.runtime._call("stream_add_callback", self.handle, callback)

    def close(self) -> None:
        """Wait for the stream's work and release it."""
        if self._owned and self.handle is not None:
            handle, self.handle = self.handle, None
            self.runtime._call("destroy_stream", handle)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _handle(stream: "Stream | None") -> Any:
    return None if stream is None else stream.handle
