"""off_loop: a handler's CPU-heavy step (parsing a body, tokenizing a prompt) off the event loop,
so /v1/models, /readyz and /metrics keep answering meanwhile (issue 12)."""
from __future__ import annotations

import asyncio
import contextvars
import functools
from typing import Any, Callable

_threads = True  # False once a thread could not start: then every call runs inline


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a worker thread; context variables (the request id in logs) go along.

    Under Pyodide (Cloudflare's Python Workers: one thread per isolate) it runs inline: the
    WebLoop's run_in_executor calls fn in place, and where a loop would start a thread and cannot
    ("can't start new thread", raised before fn runs) the first refusal switches every later call
    to inline."""
    global _threads
    if _threads:
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        try:
            future = asyncio.get_running_loop().run_in_executor(None, call)
        except RuntimeError:  # the thread did not start: fn has not run
            _threads = False
        else:
            return await future
    return fn(*args)
