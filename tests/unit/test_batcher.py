"""services.batcher.Batcher: concurrent submissions coalesce; results and errors reach their own caller."""
import asyncio

import pytest

from services.batcher import Batcher


class Recorder:
    def __init__(self, fail_on=None, delay=0.01):
        self.calls: list[list] = []
        self.fail_on, self.delay = fail_on, delay

    async def __call__(self, items):
        self.calls.append(list(items))
        await asyncio.sleep(self.delay)  # a forward that takes time: newcomers queue up
        if self.fail_on in items and self.fail_on == "boom-all":
            raise RuntimeError("the whole batch failed")
        return [ValueError(f"bad {i}") if i == self.fail_on else i * 10 for i in items]


async def test_concurrent_items_share_batches_and_get_their_own_results():
    run = Recorder()
    b = Batcher(run, max_batch=16)
    got = await asyncio.gather(*(b.submit(i) for i in range(6)))
    assert got == [i * 10 for i in range(6)]
    assert sorted(x for c in run.calls for x in c) == list(range(6))
    assert len(run.calls) < 6 and b.stats()["largest_batch"] > 1


async def test_items_arriving_during_a_batch_form_the_next_one():
    run = Recorder(delay=0.05)
    b = Batcher(run)
    first = asyncio.ensure_future(b.submit(1))
    await asyncio.sleep(0.01)  # batch [1] is running
    later = [asyncio.ensure_future(b.submit(i)) for i in (2, 3, 4)]
    assert await asyncio.gather(first, *later) == [10, 20, 30, 40]
    assert run.calls == [[1], [2, 3, 4]]


async def test_max_batch_and_unbatchable_items_run_alone():
    run = Recorder()
    b = Batcher(run, batchable=lambda i: i % 2 == 0, max_batch=2)
    assert await asyncio.gather(*(b.submit(i) for i in (0, 1, 2, 4, 3, 6))) == [0, 10, 20, 40, 30, 60]
    assert all(len(c) == 1 for c in run.calls if any(x % 2 for x in c))
    assert max(len(c) for c in run.calls) == 2


async def test_an_item_error_reaches_only_its_caller():
    b = Batcher(Recorder(fail_on=3))
    res = await asyncio.gather(*(b.submit(i) for i in range(5)), return_exceptions=True)
    assert [r for i, r in enumerate(res) if i != 3] == [0, 10, 20, 40]
    assert isinstance(res[3], ValueError) and "bad 3" in str(res[3])


async def test_a_batch_error_reaches_every_caller_of_that_batch_and_the_batcher_goes_on():
    b = Batcher(Recorder(fail_on="boom-all"))
    res = await asyncio.gather(b.submit("boom-all"), b.submit(2), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in res)
    assert await b.submit(7) == 70


async def test_a_cancelled_caller_does_not_cancel_the_others():
    run = Recorder(delay=0.05)
    b = Batcher(run)
    a, c = asyncio.ensure_future(b.submit(1)), asyncio.ensure_future(b.submit(2))
    await asyncio.sleep(0.01)
    a.cancel()  # its client went away mid-batch
    assert await c == 20
    with pytest.raises(asyncio.CancelledError):
        await a


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="max_batch"):
        Batcher(Recorder(), max_batch=0)
