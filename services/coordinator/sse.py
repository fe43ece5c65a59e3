"""Server-sent events for the streaming endpoints, and a stream whose cleanup always runs."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering either


def sse(obj: Any) -> bytes:
    """One event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


class ClosingStream:
    """Async iterator of bytes over `chunks` that calls `on_close` exactly once: at the end, on an
    error, or on aclose(), even when it was never iterated (an async generator that never started
    would skip its own `finally`, so a slot taken before it starts is given back here)."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]):
        self._chunks, self._on_close = chunks, on_close
        self._closed = False

    def __aiter__(self) -> "ClosingStream":
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        try:
            return await self._chunks.__anext__()
        except BaseException:  # the end (StopAsyncIteration), a failure, or cancellation
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._chunks, "aclose", None)
            if close is not None:
                await close()
        finally:
            self._on_close()
