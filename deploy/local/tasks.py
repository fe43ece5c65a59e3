"""wait_until: every background task has an owner that logs its failure and awaits it on shutdown.

Seed section 8 ("Missing ctx.waitUntil on KV writes"): work registered after the response must
not be orphaned by teardown, so drain() waits for it (and for tasks it spawns) before the
process exits; only a task still running at the deadline is cancelled, and that is logged.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable

log = logging.getLogger(__name__)


class BackgroundTasks:
    def __init__(self, name: str = "wait_until"):
        self.name = name
        self._tasks: set[asyncio.Future] = set()
        self.started = 0
        self.completed = 0
        self.failed = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, awaitable: Awaitable[Any]) -> None:
        """ctx.wait_until: run the awaitable to completion in the background."""
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        self.started += 1
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            self.failed += 1
            log.warning("%s task cancelled", self.name)
            return
        exc = task.exception()
        if exc is not None:
            self.failed += 1
            log.error("%s task failed: %s: %s", self.name, type(exc).__name__, exc, exc_info=exc)
        else:
            self.completed += 1

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Await every task, including ones added while draining; cancel what is left at the deadline."""
        deadline = time.monotonic() + timeout_s
        while self._tasks:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pending = list(self._tasks)
                log.error("%s: %d tasks still running after %.1f s; cancelling them",
                          self.name, len(pending), timeout_s)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return
            await asyncio.wait(set(self._tasks), timeout=remaining)

    def stats(self) -> dict[str, int]:
        return {"running": len(self._tasks), "started": self.started, "completed": self.completed,
                "failed": self.failed}
