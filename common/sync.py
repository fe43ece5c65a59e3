"""Step async code whose awaits never suspend, without an event loop.

The layer loop and the generation loop are written once, as async code, because the services
await network loads. The single process supplies everything in place (its weights are resident,
its "engine calls" return at once), so those coroutines finish without ever yielding to an event
loop, and these helpers run them directly. That is also why the single process may be called from
code that is itself running in an event loop (a test's, a benchmark's).
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Coroutine, Iterator, TypeVar

T = TypeVar("T")


class WouldSuspend(RuntimeError):
    """An await in code run by run_sync() needed an event loop."""


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """The coroutine's result; WouldSuspend if it awaits anything that is not ready (raised inside
    it first, so its own cleanup runs)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    what = getattr(coro, "__qualname__", type(coro).__name__)
    coro.throw(WouldSuspend(f"{what} awaited what only an event loop can finish: run it in one instead"))
    coro.close()  # it caught the error and awaited again
    raise WouldSuspend(f"{what} suspended twice")


def iterate_sync(agen: AsyncIterator[T]) -> Iterator[T]:
    """The items of an async generator whose awaits never suspend; it is closed however iteration ends."""
    try:
        while True:
            try:
                yield run_sync(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        run_sync(agen.aclose())
