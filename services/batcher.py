"""Coalesce concurrent requests into one batched call (decode batching at stations and shards).

Requests that arrive while a batch runs wait; when it ends they run together as the next
batch, so the weights are read once per step for every session (issue 7). A lone request
runs at once, as a batch of one. Pure asyncio: no framework, so Workers can run it too.

    batcher = Batcher(run, batchable=lambda item: item.is_decode, max_batch=16)
    result = await batcher.submit(item)

`run(items)` returns one result per item, in order; a result that is an exception is raised
to that item's caller only. If `run` itself raises, every caller of that batch gets the error.
Items that are not batchable run alone, in arrival order with the rest.

Fair scheduling (issue 52): a long item's run may call `interject()` between its steps (a
station, between two phases of a long prefill chunk). The items waiting then that `interjects`
admits (short ones) run at that point, grouped as _take groups them, instead of waiting for the
whole long item; those that arrive meanwhile wait for the next such point. run() may answer
LATER for an interjected item (it cannot run beside the paused one): it waits, at the front of
the queue, for the long item to end, and is not tried again before.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, Sequence, TypeVar

I = TypeVar("I")
R = TypeVar("R")


class Later:
    """run()'s result for an interjected item that must wait until the running item has ended."""

    def __repr__(self) -> str:
        return "LATER"


LATER = Later()


class Batcher(Generic[I, R]):
    def __init__(self, run: Callable[[list[I]], Awaitable[Sequence[R | BaseException | Later]]],
                 batchable: Callable[[I], bool] = lambda item: True, max_batch: int = 16,
                 interjects: Callable[[I], bool] = lambda item: False,
                 quorum: Callable[[], int] | None = None, linger_s: float = 0.0):
        """quorum: how many items a batch should wait for (the callers known to come back, as the
        generations a coordinator steps); a batch waits up to linger_s for them to arrive."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._run, self._batchable, self.max_batch = run, batchable, max_batch
        self._interjects = interjects
        self._quorum, self._linger_s = quorum, linger_s
        self._full: asyncio.Future | None = None  # set once the quorum has arrived
        self._want = 0
        self.lingered = 0  # batches that waited for their quorum
        self._waiting: list[tuple[I, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.batches = 0
        self.items = 0
        self.largest = 0
        self.interjected = 0  # items run inside another item's run (interject())
        self._later: set[int] = set()  # id() of the entries answered LATER during the running item

    async def submit(self, item: I) -> R:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((item, fut))
        if self._full is not None and len(self._waiting) >= self._want and not self._full.done():
            self._full.set_result(None)
        if self._worker is None or self._worker.done():
            # Its own task: a caller that is cancelled (client gone) must not cancel the batch
            # that other callers are waiting on.
            self._worker = asyncio.ensure_future(self._drain())
        return await fut

    def _take(self) -> list[tuple[I, asyncio.Future]]:
        batch = self._group(self._waiting)
        self._waiting = _without(self._waiting, batch)
        return batch

    def _group(self, entries: list[tuple[I, asyncio.Future]]) -> list[tuple[I, asyncio.Future]]:
        """The next batch from entries (in arrival order): the first alone if it is not batchable,
        else the batchable ones, up to max_batch."""
        if not self._batchable(entries[0][0]):
            return entries[:1]
        return [e for e in entries if self._batchable(e[0])][:self.max_batch]

    def _may_interject(self, entry: tuple[I, asyncio.Future]) -> bool:
        return self._interjects(entry[0]) and not entry[1].cancelled() and id(entry) not in self._later

    def interject_waiting(self) -> bool:
        """Whether an item that interject() would run is waiting."""
        return any(self._may_interject(e) for e in self._waiting)

    async def interject(self) -> int:
        """From inside run(), between two steps of a long item: run the items waiting now that
        `interjects` admits, grouped as _take groups them, before the long item goes on -> how
        many ran. The caller's run() is suspended meanwhile; whatever raises here raises there."""
        mine = [e for e in self._waiting if self._may_interject(e)]
        self._waiting = _without(self._waiting, mine)
        n = 0
        try:
            while mine:
                batch = self._group(mine)
                mine = _without(mine, batch)
                n += await self._settle(batch, interjected=True)
        finally:
            self._waiting[:0] = mine  # not reached (the long item failed or was cancelled): queued again
        return n

    async def _drain(self) -> None:
        while self._waiting:
            # One turn of the loop first: requests parsed in the same turn as the first join it.
            await asyncio.sleep(0)
            await self._linger()
            batch = [(i, f) for i, f in self._take() if not f.cancelled()]
            if batch:
                await self._settle(batch)
                self._later.clear()  # the item they waited for has ended

    async def _linger(self) -> None:
        """Wait up to linger_s for the quorum's items, while fewer are waiting."""
        want = min(self._quorum(), self.max_batch) if self._quorum is not None and self._linger_s > 0 else 0
        if len(self._waiting) >= want:
            return
        self._full, self._want = asyncio.get_running_loop().create_future(), want
        self.lingered += 1
        try:
            async with asyncio.timeout(self._linger_s):
                await self._full
        except TimeoutError:
            pass
        finally:
            self._full = None

    async def _settle(self, batch: list[tuple[I, asyncio.Future]], interjected: bool = False) -> int:
        """Run one batch and hand each caller its result -> how many ran (LATER ones are queued
        again, first)."""
        try:
            results = await self._run([i for i, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"batch of {len(batch)} returned {len(results)} results")
        except Exception as e:  # noqa: BLE001 - handed to every caller of this batch
            results = [e] * len(batch)
        except BaseException:  # cancelled (shutdown): nobody may wait forever
            for _, f in batch + self._waiting:
                if not f.done():
                    f.set_exception(RuntimeError("batch cancelled: the service is shutting down"))
            self._waiting = []
            raise
        later = [e for e, r in zip(batch, results) if r is LATER]
        self._waiting[:0] = later
        self._later.update(id(e) for e in later)
        for (_, f), r in zip(batch, results):
            if f.done() or r is LATER:
                continue
            if isinstance(r, BaseException):
                f.set_exception(r)
            else:
                f.set_result(r)
        ran = len(batch) - len(later)
        if ran:
            self.batches += 1
            self.items += ran
            self.largest = max(self.largest, ran)
        if interjected:
            self.interjected += ran
        return ran

    def stats(self) -> dict:
        return {"batches": self.batches, "batched_items": self.items, "largest_batch": self.largest,
                "interjected_items": self.interjected, "lingered_batches": self.lingered}


def _without(entries: list, taken: list) -> list:
    """entries less those in taken (by identity), in order."""
    ids = {id(e) for e in taken}
    return [e for e in entries if id(e) not in ids]
