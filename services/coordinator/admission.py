"""Admission: at most `max_active` generations run at once, at most `max_queued` wait for a slot
(first come, first served); beyond that the answer is 429 with Retry-After."""
from __future__ import annotations

import asyncio
from collections import deque

from services.coordinator.errors import TooManyRequests


class Admission:
    def __init__(self, max_active: int, max_queued: int, retry_after_s: int):
        assert max_active >= 1 and max_queued >= 0 and retry_after_s >= 1
        self.max_active, self.max_queued, self.retry_after_s = max_active, max_queued, retry_after_s
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self) -> None:
        """Take a slot, waiting in line if all are busy; TooManyRequests when the line is full too."""
        if self.active < self.max_active and not self.queued:
            self.active += 1
            return
        if self.queued >= self.max_queued:
            raise TooManyRequests(
                f"the coordinator is busy: {self.active} requests running (MAX_CONCURRENT_REQUESTS="
                f"{self.max_active}) and {self.queued} queued (MAX_QUEUED_REQUESTS={self.max_queued}); "
                f"retry after {self.retry_after_s} s", headers={"Retry-After": str(self.retry_after_s)})
        slot = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self.release()  # handed a slot just as we were cancelled: pass it on
            else:
                slot.cancel()
            raise

    def release(self) -> None:
        """Give the slot to the next in line, or free it."""
        while self._waiters:
            slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(None)  # the slot changes hands; `active` stays
                return
        self.active -= 1
        assert self.active >= 0, "released more slots than were taken"
