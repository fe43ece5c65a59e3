"""The coordinator's subrequests, counted per invocation, and a generation's length bounded by them.

On Cloudflare every call a Worker makes through a binding (a service binding or Durable Object
stub's fetch, an R2 read) is a subrequest, and an invocation may make SUBREQUEST_LIMIT of them (the
plan's: docs/cloudflare.md, Limits); the one past it throws, which mid-stream would end a generation
with an error. So the coordinator counts them (its bindings are wrapped at boot: counted()), and
after every trip bounds the generation's max_tokens by what is left, so it ends with finish_reason
"length" one trip before the limit would be crossed, and says why (limited_by "subrequests").

    counter = begin(limit)               # per invocation (the handler's fetch); None: no limit
    counted(binding)                     # a Service or Bucket whose calls add to the current counter
    cost = HopCost(stations, shards)    # worst case per trip: embed owners + stations + LM-head shards
    bound(gen, counter, cost)            # after a trip: gen.max_tokens <= what the rest affords

The counter is found through a context variable, so the wrapped bindings (built once, shared by
every request) count into the request that makes the call; a generation keeps its invocation's
counter (Generation.subrequests) and sets it again wherever it resumes (a stream's consumer may
drive it from another task). A wait_until task copies the context: the stations' releases at the
end of a generation count too, and a generation reserves them from the start.

Not budgeted in advance: a replay after a station lost a KV session (it re-runs every trip so far),
and a prompt whose cached blocks a station no longer held (it runs again from 0); each is counted
when it happens, so the trips after it are bounded by what is left.
"""
from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from common.kvcache import prefill_chunks
from common.prefix import reusable_blocks

LIMITED_BY = "subrequests"
LIMITED_HEADER = "X-Knot-Limited-By"  # on a whole reply: why it ended before max_tokens


class Counter:
    """One invocation's subrequests: used so far, the limit (None: none), and the release calls its
    running generations will still make (reserved)."""

    def __init__(self, limit: int | None):
        self.limit, self.used, self.reserved, self.generations = limit, 0, 0, 0

    def add(self, n: int = 1) -> None:
        self.used += n

    def left(self) -> float:
        return math.inf if self.limit is None else self.limit - self.used - self.reserved

    def as_json(self) -> dict:
        return {"used": self.used, "limit": self.limit}


_current: ContextVar[Counter | None] = ContextVar("knot_subrequests", default=None)


def begin(limit: int | None) -> Counter:
    """A new invocation's counter, current from here on in this context."""
    counter = Counter(limit)
    _current.set(counter)
    return counter


def current() -> Counter | None:
    return _current.get()


def enter(counter: Counter | None) -> None:
    """Make counter current again (a generation resumed from another task)."""
    if counter is not None and _current.get() is not counter:
        _current.set(counter)


def leave() -> None:
    """No invocation is current in this task (a call made for several: each counts it, Counter.add)."""
    _current.set(None)


def _count() -> None:
    counter = _current.get()
    if counter is not None:
        counter.add()


class CountedService:
    """A Service (or a DO-backed one) whose every fetch is one subrequest of the current invocation."""

    def __init__(self, inner: Any):
        self.inner = inner

    async def fetch(self, request):
        _count()
        return await self.inner.fetch(request)

    def __getattr__(self, name: str) -> Any:  # anything else the clients ask of the binding
        return getattr(self.inner, name)


class CountedBucket:
    """A Bucket whose every call is one subrequest of the current invocation."""

    def __init__(self, inner: Any):
        self.inner = inner

    async def head(self, key, *args, **kwargs):
        _count()
        return await self.inner.head(key, *args, **kwargs)

    async def get(self, key, *args, **kwargs):
        _count()
        return await self.inner.get(key, *args, **kwargs)

    async def put(self, key, *args, **kwargs):
        _count()
        return await self.inner.put(key, *args, **kwargs)

    async def list(self, *args, **kwargs):
        _count()
        return await self.inner.list(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def counted(binding: Any) -> Any:
    """binding, counted: a Bucket (it has get) or a Service (fetch); None stays None."""
    if binding is None or isinstance(binding, (CountedService, CountedBucket)):
        return binding
    return CountedBucket(binding) if hasattr(binding, "get") and hasattr(binding, "head") else CountedService(binding)


@dataclass(frozen=True)
class HopCost:
    """Subrequests of the coordinator's hops, at most: a trip embeds its tokens (one call per shard that
    owns one of them), runs every station, and gathers every shard's LM-head slice; a draft model adds
    its /draft; the end releases the session on every station (and the drafter)."""

    stations: int
    shards: int
    drafter: bool = False

    def trip(self, n_tokens: int = 1) -> int:
        return min(n_tokens, self.shards) + self.stations + self.shards + int(self.drafter)

    def prompt(self, n_prompt: int) -> int:
        """The prompt's trip: its chunks through the embedding and the stations, then one LM-head gather;
        a prompt of a whole block and more first asks each station which of its blocks it keeps."""
        chunks = prefill_chunks(n_prompt)
        probe = self.stations if reusable_blocks(n_prompt) else 0
        return (sum(min(b - a, self.shards) + self.stations for a, b in chunks) + probe + self.shards +
                int(self.drafter))

    def release(self) -> int:
        return self.stations + int(self.drafter)

    def longest(self, limit: int, n_prompt: int = 1, overhead: int = 1) -> int:
        """The most tokens one generation gets within limit subrequests (after `overhead` calls of the
        request itself: the bucket's version check), without drafts."""
        per_token = self.trip(1)
        if per_token == 0:
            raise ValueError(f"{self}: a layout without stations or shards makes no trips to count")
        left = limit - overhead - self.release() - self.prompt(n_prompt)
        return 0 if left < 0 else 1 + left // per_token


def reserve(gen: Any, counter: Counter | None, cost: HopCost) -> None:
    """At a generation's start: its asked max_tokens noted (gen.asked_tokens), its releases reserved,
    and when what is left cannot pay its prompt, it is given no tokens (max_tokens 0: it ends with
    "length" at once)."""
    gen.asked_tokens = gen.max_tokens
    if counter is None:
        return
    counter.reserved += cost.release()
    counter.generations += 1
    if counter.left() < cost.prompt(len(gen.prompt_ids)):
        gen.max_tokens = 0


def bound(gen: Any, counter: Counter | None, cost: HopCost, drafts: int = 0) -> None:
    """After a trip (its tokens not yet taken): gen.max_tokens no more than the asked max_tokens and the
    tokens the trips still affordable give at least, one each, this invocation's running generations
    sharing what is left. drafts: the most tokens a later trip drafts (each trip sends drafts + 1)."""
    if counter is None or counter.limit is None:
        return
    share = counter.left() // max(1, counter.generations)
    trips = max(0, int(share // cost.trip(drafts + 1)))
    gen.max_tokens = min(gen.asked_tokens, len(gen.token_ids) + 1 + trips)


def finish(counter: Counter | None, cost: HopCost) -> None:
    """A generation ended: its releases are about to be made (and counted), no longer reserved."""
    if counter is not None:
        counter.reserved -= cost.release()
        counter.generations -= 1


def limited(gen: Any) -> bool:
    """Whether gen ended short of its asked max_tokens because of the subrequest limit."""
    return gen.finish_reason == "length" and len(gen.token_ids) < gen.asked_tokens
