"""services.batcher.Batcher: concurrent submissions coalesce; results and errors reach their own caller."""
import asyncio

import pytest

from services.batcher import LATER, Batcher


class Recorder:
    """A forward that takes time, so newcomers queue up; with gated=True each batch runs until the
    test opens `gate` (and `running` is set once a batch is under way)."""

    def __init__(self, fail_on=None, delay=0.01, gated=False):
        self.calls: list[list] = []
        self.fail_on, self.delay = fail_on, delay
        self.running, self.gate = asyncio.Event(), asyncio.Event() if gated else None

    async def __call__(self, items):
        self.calls.append(list(items))
        self.running.set()
        if self.gate is not None:
            await self.gate.wait()
        else:
            await asyncio.sleep(self.delay)
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
    run = Recorder(gated=True)
    b = Batcher(run)
    first = asyncio.ensure_future(b.submit(1))
    await run.running.wait()  # batch [1] is running
    later = [asyncio.ensure_future(b.submit(i)) for i in (2, 3, 4)]
    await queued(b, 3)
    run.gate.set()
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
    run = Recorder(gated=True)
    b = Batcher(run)
    a, c = asyncio.ensure_future(b.submit(1)), asyncio.ensure_future(b.submit(2))
    await run.running.wait()
    assert run.calls == [[1, 2]]  # one batch, under way
    a.cancel()  # its client went away mid-batch
    await asyncio.sleep(0)
    run.gate.set()
    assert await c == 20
    with pytest.raises(asyncio.CancelledError):
        await a


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="max_batch"):
        Batcher(Recorder(), max_batch=0)


class Steps:
    """A run() whose "long" items take several steps and let short items interject between them."""

    def __init__(self, batcher_box: list, steps: int = 4, later: set = frozenset()):
        self.box, self.steps, self.later = batcher_box, steps, later
        self.log: list = []
        self.paused = False
        self.first_step = asyncio.Event()  # set once the long item's first step runs
        self.go = asyncio.Event()  # ... which ends when the test sets this

    async def __call__(self, items):
        if items == ["long"]:
            for k in range(self.steps):
                self.log.append(("long", k))
                if k == 0:
                    self.first_step.set()
                    await self.go.wait()
                else:
                    await asyncio.sleep(0.01)  # one step
                self.paused = True
                await self.box[0].interject()
                self.paused = False
            return ["long done"]
        self.log.append(tuple(items))
        return [LATER if self.paused and i in self.later else f"{i} done" for i in items]


def short(item) -> bool:
    return item != "long"


async def queued(b: Batcher, n: int) -> None:
    """Until n items wait in b's queue (the submissions just started have reached it)."""
    while len(b._waiting) < n:
        await asyncio.sleep(0)


async def test_short_items_run_between_the_steps_of_a_long_one():
    """Fair scheduling: items submitted while a long item runs run at its next step boundary (the
    batchable ones as one batch), not after it; the long one goes on afterwards."""
    box: list = []
    run = Steps(box)
    b = Batcher(run, batchable=lambda i: i.startswith("d"), interjects=short)
    box.append(b)
    done: list = []

    async def submit(i):
        r = await b.submit(i)
        done.append(i)
        return r

    long = asyncio.ensure_future(submit("long"))
    await run.first_step.wait()
    firsts = [asyncio.ensure_future(submit(i)) for i in ("d1", "p1", "d2")]
    await queued(b, 3)
    run.go.set()
    await asyncio.gather(*firsts)
    assert not long.done(), "the short items finished while the long one still ran"
    assert await long == "long done"
    assert done[-1] == "long" and set(done[:3]) == {"d1", "p1", "d2"}
    # between step 0 and step 1: the decodes as one batch, the unbatchable one alone
    i = run.log.index(("long", 0))
    assert run.log[i + 1:i + 3] == [("d1", "d2"), ("p1",)] and run.log[i + 3] == ("long", 1)
    assert b.stats()["interjected_items"] == 3


async def test_items_that_are_not_short_wait_and_later_items_wait_for_the_end():
    """Only what `interjects` admits runs between steps; an item run() answers LATER for waits at
    the front of the queue until the long item has ended, then runs."""
    box: list = []
    run = Steps(box, later={"d9"})
    b = Batcher(run, batchable=lambda i: i.startswith("d"), interjects=lambda i: i.startswith("d"))
    box.append(b)
    long = asyncio.ensure_future(b.submit("long"))
    await run.first_step.wait()
    other = asyncio.ensure_future(b.submit("p-long"))  # not short: after the long one
    deferred = asyncio.ensure_future(b.submit("d9"))
    await queued(b, 2)
    run.go.set()
    assert await deferred == "d9 done" and await long == "long done" and await other == "p-long done"
    # d9 was tried once between steps, answered LATER, and ran once the long item had ended, before p-long
    assert run.log.index(("d9",)) < run.log.index(("long", 1)) and run.log.count(("d9",)) == 2
    assert run.log[-2:] == [("d9",), ("p-long",)]
    assert b.stats()["interjected_items"] == 0


async def test_a_failing_interjected_item_fails_alone():
    box: list = []

    started, go = asyncio.Event(), asyncio.Event()

    async def run(items):
        if items == ["long"]:
            started.set()
            await go.wait()
            await box[0].interject()
            await asyncio.sleep(0.01)
            return ["long done"]
        raise RuntimeError("the short batch failed")

    b = Batcher(run, interjects=short)
    box.append(b)
    long = asyncio.ensure_future(b.submit("long"))
    await started.wait()
    short_one = asyncio.ensure_future(b.submit("d1"))
    await queued(b, 1)
    go.set()
    with pytest.raises(RuntimeError, match="short batch"):
        await short_one
    assert not long.done() and await long == "long done"


async def test_a_batch_waits_for_its_quorum_then_runs_them_together():
    """A coordinator's decode steps: a batch waits (up to linger_s) for the callers known to come
    back, so a caller that lags by its token's work still shares the step."""
    rec = Recorder()
    b = Batcher(rec, quorum=lambda: 3, linger_s=5.0)

    async def late(i, delay):
        await asyncio.sleep(delay)
        return await b.submit(i)

    assert await asyncio.gather(late(1, 0), late(2, 0.02), late(3, 0.04)) == [10, 20, 30]
    assert rec.calls == [[1, 2, 3]] and b.lingered == 1


async def test_a_quorum_that_does_not_come_is_waited_for_only_linger_s():
    rec = Recorder()
    b = Batcher(rec, quorum=lambda: 5, linger_s=0.05)
    t0 = asyncio.get_running_loop().time()
    assert await asyncio.gather(b.submit(1), b.submit(2)) == [10, 20]
    assert rec.calls == [[1, 2]]
    assert 0.04 <= asyncio.get_running_loop().time() - t0 < 1.0
    # a quorum already there (or none asked for) waits for nothing
    b2 = Batcher(Recorder(), quorum=lambda: 1, linger_s=5.0)
    assert await asyncio.wait_for(b2.submit(4), 1.0) == 40 and b2.lingered == 0
