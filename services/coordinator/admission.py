"""Admission: at most `max_active` generations run at once, at most `max_queued` wait for a slot
(first come, first served); beyond that the answer is 429 with Retry-After."""
from __future__ import annotations

import asyncio
from collections import deque

from services.coordinator.errors import TooManyRequests


class Admission:
    """Slots for generations: a request of n choices takes its n at once (one waiter in the line),
    so two requests holding part of what each needs can never wait on each other."""

    def __init__(self, max_active: int, max_queued: int, retry_after_s: int):
        assert max_active >= 1 and max_queued >= 0 and retry_after_s >= 1
        self.max_active, self.max_queued, self.retry_after_s = max_active, max_queued, retry_after_s
        self.active = 0
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()  # (granted when done, slots it needs)

    @property
    def queued(self) -> int:
        return sum(1 for f, _ in self._waiters if not f.done())

    async def acquire(self, n: int = 1) -> None:
        """Take n slots, waiting in line if they are not free; TooManyRequests when the line is full too."""
        assert 1 <= n <= self.max_active, f"{n} slots of {self.max_active}: the caller checks n"
        if self.active + n <= self.max_active and not self.queued:
            self.active += n
            return
        if self.queued >= self.max_queued:
            raise TooManyRequests(
                f"the coordinator is busy: {self.active} generations running (MAX_CONCURRENT_REQUESTS="
                f"{self.max_active}) and {self.queued} requests queued (MAX_QUEUED_REQUESTS={self.max_queued}); "
                f"retry after {self.retry_after_s} s", headers={"Retry-After": str(self.retry_after_s)})
        slot = asyncio.get_running_loop().create_future()
        self._waiters.append((slot, n))
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self.release(n)  # granted just as we were cancelled: pass them on
            else:
                slot.cancel()
                self._grant()  # the ones behind us may fit where we did not
            raise

    def release(self, n: int = 1) -> None:
        """Give n slots back: to the line, first come first served, as far as they go."""
        self.active -= n
        assert self.active >= 0, "released more slots than were taken"
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            slot, n = self._waiters[0]
            if slot.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if self.active + n > self.max_active:
                return  # first come, first served: nobody overtakes the head of the line
            self._waiters.popleft()
            self.active += n
            slot.set_result(None)
