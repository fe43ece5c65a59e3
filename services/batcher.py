"""Coalesce concurrent requests into one batched call (decode batching at stations and shards).

Requests that arrive while a batch runs wait; when it ends they run together as the next
batch, so the weights are read once per step for every session (issue 7). A lone request
runs at once, as a batch of one. Pure asyncio: no framework, so Workers can run it too.

    batcher = Batcher(run, batchable=lambda item: item.is_decode, max_batch=16)
    result = await batcher.submit(item)

`run(items)` returns one result per item, in order; a result that is an exception is raised
to that item's caller only. If `run` itself raises, every caller of that batch gets the error.
Items that are not batchable run alone, in arrival order with the rest.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, Sequence, TypeVar

I = TypeVar("I")
R = TypeVar("R")


class Batcher(Generic[I, R]):
    def __init__(self, run: Callable[[list[I]], Awaitable[Sequence[R | BaseException]]],
                 batchable: Callable[[I], bool] = lambda item: True, max_batch: int = 16):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._run, self._batchable, self.max_batch = run, batchable, max_batch
        self._waiting: list[tuple[I, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.batches = 0
        self.items = 0
        self.largest = 0

    async def submit(self, item: I) -> R:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((item, fut))
        if self._worker is None or self._worker.done():
            # Its own task: a caller that is cancelled (client gone) must not cancel the batch
            # that other callers are waiting on.
            self._worker = asyncio.ensure_future(self._drain())
        return await fut

    def _take(self) -> list[tuple[I, asyncio.Future]]:
        first = self._waiting[0]
        if not self._batchable(first[0]):
            return [self._waiting.pop(0)]
        batch, rest = [], []
        for entry in self._waiting:
            (batch if len(batch) < self.max_batch and self._batchable(entry[0]) else rest).append(entry)
        self._waiting = rest
        return batch

    async def _drain(self) -> None:
        while self._waiting:
            # One turn of the loop first: requests parsed in the same turn as the first join it.
            await asyncio.sleep(0)
            batch = [(i, f) for i, f in self._take() if not f.cancelled()]
            if not batch:
                continue
            self.batches += 1
            self.items += len(batch)
            self.largest = max(self.largest, len(batch))
            try:
                results = await self._run([i for i, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"batch of {len(batch)} returned {len(results)} results")
            except Exception as e:  # noqa: BLE001 - handed to every caller of this batch
                for _, f in batch:
                    if not f.done():
                        f.set_exception(e)
                continue
            except BaseException:  # cancelled (shutdown): nobody may wait forever
                for _, f in batch + self._waiting:
                    if not f.done():
                        f.set_exception(RuntimeError("batch cancelled: the service is shutting down"))
                self._waiting = []
                raise
            for (_, f), r in zip(batch, results):
                if f.done():
                    continue
                if isinstance(r, BaseException):
                    f.set_exception(r)
                else:
                    f.set_result(r)

    def stats(self) -> dict:
        return {"batches": self.batches, "batched_items": self.items, "largest_batch": self.largest}
