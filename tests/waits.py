"""Waiting for an event in a test: poll a condition until it holds or a deadline passes, so the
order of events is observed, never assumed from a fixed sleep (a 2-core CI machine under load
makes any fixed sleep too short sometimes)."""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout_s: float = 10.0, what: str = "condition", poll_s: float = 0.05) -> T:
    """check()'s first truthy value; AssertionError naming `what` if none comes within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not met within {timeout_s} s")
        time.sleep(poll_s)


async def until(check: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition",
                poll_s: float = 0.005) -> Any:
    """The same for a test on the event loop: the other tasks run while it waits; check may be a
    coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not met within {timeout_s} s")
        await asyncio.sleep(poll_s)
