"""The OpenAI-compatible API (docs/api.md):

    POST /v1/completions         prompt -> text          (stream: SSE "text_completion" chunks)
    POST /v1/chat/completions    messages -> message     (stream: SSE "chat.completion.chunk" chunks)
    GET  /v1/models, /v1/models/<id>

Both generation endpoints run Coordinator.events(); a stream ends with `data: [DONE]`. Errors use
OpenAI's shape (services/coordinator/errors.py); once a stream has started, an error is sent as a
`data: {"error": ...}` event before [DONE], since the status line is already out.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from common.constraints import Grammar
from common.generation import FinishEvent, Generation, TokenEvent
from common.prefix import PREFIX_BLOCK_TOKENS
from common.runtime import Response, status_for
from services.coordinator.errors import InvalidParam, openai_error_body
from services.coordinator import subrequests
from services.coordinator.coordinator import Coordinator, policy_headers
from services.coordinator.params import (GenerateRequest, cache_prompt, chat_message, fim_suffix, number,
                                         sampling_params, shard_failure, speculation_request, stop_strings)
from services.coordinator.sse import SSE_DONE, SSE_HEADERS, ClosingStream, sse
from services.coordinator.tools import ToolRequest, ToolStream, parse_tools, split_calls
from services.offload import off_loop

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
MAX_TOP_LOGPROBS = 20
# A request's n choices take n admission slots and n KV sessions on every station: at most this
# many, and at most MAX_CONCURRENT_REQUESTS (Coordinator.prepare_choices).
MAX_CHOICES = 8


@dataclass(frozen=True)
class Options:
    chat: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage and no choices
    n: int = 1  # choices: one generation each, run side by side (batched by the stations and shards)
    tools: ToolRequest | None = None  # chat: replies may be tool calls (services/coordinator/tools.py)


# ---------------------------------------------------------------- parsing


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise InvalidParam("the body must be a JSON object")
    return body


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidParam(f"{name} must be a boolean, got {v!r}", name)
    return v


def _unsupported(body: dict, name: str, why: str) -> None:
    """A feature we lack: absent, null, false or empty is fine; anything else is a 400 naming it."""
    v = body.get(name)
    if v is not None and v is not False and v != "" and v != [] and v != {}:
        raise InvalidParam(f"{name}={v!r} is not supported ({why})", name)


def _common(body: dict, chat: bool) -> Options:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidParam(f"model must be a string, got {model!r}", "model")
    n = number(body, "n", 1, lo=1, hi=MAX_CHOICES, integer=True)
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise InvalidParam("stream_options must be an object", "stream_options")
    include_usage = stream and _bool(opts or {}, "include_usage")
    return Options(chat, stream, include_usage, n)


# Chat's fields that change what a completion must be: ignored, they would give a 200 that is not
# what was asked (a tool call, a JSON object). Any other unknown field is ignored, as OpenAI does.
CHAT_ONLY_FIELDS = ("messages", "tools", "functions", "tool_choice", "function_call", "parallel_tool_calls",
                    "response_format")


def _chat_only(body: dict) -> None:
    """A /v1/completions body with a field only chat can honour: a 400 naming it (a "text" response
    format and no tools are what a completion is anyway)."""
    fmt = body.get("response_format")
    text = fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text" and len(fmt) == 1)
    for name in CHAT_ONLY_FIELDS:
        v = body.get(name)
        if (v is None or v is False or v in ("", "none") or v == [] or v == {}
                or (name == "response_format" and text)):
            continue
        raise InvalidParam(f"{name}={repr(v)[:80]}: /v1/completions cannot honour {name} (a completion only "
                           f"continues the prompt's text)", name)


def parse_completion(body: Any) -> tuple[GenerateRequest, Options]:
    body = _object(body)
    opts = _common(body, chat=False)
    _chat_only(body)
    prompt, prompt_ids = body.get("prompt"), None
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        elif len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise InvalidParam(f"prompt: a batch of {len(prompt)} prompts is not supported; send one prompt "
                               f"per request", "prompt")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidParam("prompt must be a string, or a non-empty list of token ids", "prompt")
        prompt_ids, prompt = tuple(prompt), None
    elif not isinstance(prompt, str):
        raise InvalidParam(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
    _unsupported(body, "echo", "the prompt is not echoed")
    best_of = number(body, "best_of", 1, integer=True)
    if best_of != 1:
        raise InvalidParam(f"best_of={best_of} is not supported (only 1)", "best_of")
    logprobs = number(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    max_tokens = number(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, lo=1, integer=True)
    g = GenerateRequest(prompt, None, max_tokens, sampling_params(body), stop_strings(body), prompt_ids, logprobs,
                        speculation_request(body), shard_failure(body), fim_suffix(body, prompt is not None),
                        cache_prompt=cache_prompt(body))
    return g, opts


def _message(m: Any, i: int) -> dict:
    """One chat message: its role and its content as a string (a list of text parts is joined).
    Other keys OpenAI's clients send back (`name`, `refusal`, ...) are not read (params.chat_message)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise InvalidParam(f"messages[{i}] must be an object with a string role", "messages")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidParam(f"messages[{i}].content: only text parts are supported, got {part!r}",
                                   "messages")
            parts.append(part["text"])
        content = "".join(parts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise InvalidParam(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return chat_message(m, i, content, tool_calls=True)


def parse_chat(body: Any) -> tuple[GenerateRequest, Options]:
    body = _object(body)
    opts = _common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidParam("messages must be a non-empty list of {\"role\", \"content\"}", "messages")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    _unsupported(body, "functions", "the legacy functions API; send tools")
    _unsupported(body, "function_call", "the legacy functions API; send tool_choice")
    tools = parse_tools(body)
    grammar, grammar_param = response_format(body.get("response_format")), "response_format"
    if tools is not None and tools.choice in ("required", "function"):
        if grammar is not None:
            raise InvalidParam("a response_format and a tool_choice that requires a call cannot both be met",
                               "response_format")
        grammar, grammar_param = tools.grammar(), "tool_choice"
    max_tokens = number(body, "max_completion_tokens", None, lo=1, integer=True)
    if max_tokens is None:
        max_tokens = number(body, "max_tokens", None, lo=1, integer=True)
    top = number(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    want_logprobs = _bool(body, "logprobs")
    if top is not None and not want_logprobs:
        raise InvalidParam("top_logprobs needs logprobs=true", "top_logprobs")
    g = GenerateRequest(None, messages, max_tokens, sampling_params(body), stop_strings(body), None,
                        (top or 0) if want_logprobs else None, speculation_request(body), shard_failure(body),
                        tools=tools, grammar=grammar, grammar_param=grammar_param, cache_prompt=cache_prompt(body))
    return g, dataclasses.replace(opts, tools=tools)


def response_format(fmt: Any) -> Grammar | None:
    """response_format -> the grammar the reply must match; None for text."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return Grammar("json_schema", json.dumps({"type": "object"}))
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidParam('response_format.json_schema must be {"name", "schema": {...}, "strict"}',
                               "response_format")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidParam("response_format.json_schema.name must be a string", "response_format")
        return Grammar("json_schema", json.dumps(spec.get("schema", {})))
    raise InvalidParam(f"response_format={repr(fmt)[:80]}: the type must be \"text\", \"json_object\" or "
                       f"\"json_schema\"", "response_format")


# ---------------------------------------------------------------- shapes


class Shape:
    """OpenAI's JSON for a request's generations (its n choices), whole or as chunks (chat and
    completions differ)."""

    def __init__(self, co: Coordinator, gens: list[Generation], opts: Options):
        self.co, self.gens, self.opts = co, gens, opts
        self.created = int(time.time())
        self.id = f"{'chatcmpl' if opts.chat else 'cmpl'}-{gens[0].request_id}"
        self.text_offset = [0] * len(gens)  # per choice: where its next token's text starts

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.co.model_id,
                "system_fingerprint": None, "choices": choices}

    def degradation(self) -> dict:
        """Under shard_failure "degrade", the reply says so, and which shards were missing (none: [])."""
        if self.gens[0].shard_failure != "degrade":
            return {}
        return {"shard_failure": "degrade", "degraded_shards": [d.as_json() for g in self.gens for d in g.degraded]}

    def limits(self) -> dict:
        """Why choices ended before max_tokens, when one did: the coordinator's subrequest limit (per invocation)."""
        if not any(subrequests.limited(g) for g in self.gens):
            return {}
        return {"limited_by": subrequests.LIMITED_BY, "subrequests": self.gens[0].subrequests.as_json()}

    def usage(self) -> dict:
        """The prompt once, the completions of every choice."""
        prompt, completion = len(self.gens[0].prompt_ids), sum(len(g.token_ids) for g in self.gens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.gens[0].cached_prompt_tokens}}

    def _token_str(self, tid: int) -> str:
        return self.co.tokenizer.token_bytes(tid).decode("utf-8", errors="replace")

    def logprobs(self, i: int, events: list[TokenEvent]) -> dict | None:
        if self.gens[i].logprobs is None:
            return None
        if self.opts.chat:
            def entry(tid: int, lp: float) -> dict:
                return {"token": self._token_str(tid), "logprob": lp,
                        "bytes": list(self.co.tokenizer.token_bytes(tid))}

            return {"content": [{**entry(e.id, e.logprobs.logprob),
                                 "top_logprobs": [entry(t, lp) for t, lp in e.logprobs.top]} for e in events]}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in events:
            s = self._token_str(e.id)
            out["tokens"].append(s)
            out["token_logprobs"].append(e.logprobs.logprob)
            top: dict[str, float] = {}
            for t, lp in e.logprobs.top:  # best first: where two tokens print alike, the likelier one stays
                top.setdefault(self._token_str(t), lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.text_offset[i])
            self.text_offset[i] += len(s)
        return out

    def whole(self, events: list[list[TokenEvent]]) -> dict:
        """events[i]: choice i's tokens."""
        choices = []
        for i, (g, ev) in enumerate(zip(self.gens, events)):
            finish = g.finish_reason
            body = {"message": {"role": "assistant", "content": g.text}} if self.opts.chat else {"text": g.text}
            split = split_calls(g.text, self.opts.tools) if self.opts.tools else None
            if split is not None:
                body, finish = {"message": {"role": "assistant", "content": split[0] or None,
                                            "tool_calls": split[1]}}, "tool_calls"
            choices.append({"index": i, **body, "logprobs": self.logprobs(i, ev), "finish_reason": finish})
        body = self._envelope("chat.completion" if self.opts.chat else "text_completion", choices)
        return {**body, "usage": self.usage(), **self.degradation(), **self.limits()}

    def chunk(self, i: int, text: str | None, finish: str | None = None, events: list[TokenEvent] = (),
              role: bool = False, tool_call: tuple[int, dict] | None = None) -> dict:
        """One stream chunk of choice i; the one that finishes carries the degradation fields too.
        tool_call: (its index in the reply, the call), sent whole in one delta."""
        lp = self.logprobs(i, list(events)) if events else None
        extra = {**self.degradation(), **self.limits()} if finish else {}
        if self.opts.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            if tool_call is not None:
                delta["tool_calls"] = [{"index": tool_call[0], **tool_call[1]}]
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {**self._envelope("chat.completion.chunk", [choice]), **extra}
        return {**self._envelope("text_completion", [{"index": i, "text": text or "", "logprobs": lp,
                                                      "finish_reason": finish}]), **extra}

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.opts.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": self.usage()}


# ---------------------------------------------------------------- running


async def complete(co: Coordinator, g: GenerateRequest, opts: Options, ctx) -> Response:
    # 400s (context length, bad template) before taking a slot; then one generation per choice
    gens = await off_loop(co.prepare_choices, g, opts.n)
    if not opts.stream:
        events: list[list[TokenEvent]] = [[] for _ in gens]

        async def run(gen: Generation, out: list[TokenEvent]) -> None:
            async for ev in co.events(gen, ctx):
                if isinstance(ev, TokenEvent):
                    out.append(ev)

        async with co.slot(gens[0], len(gens)):
            await _all(run(gen, out) for gen, out in zip(gens, events))
        return Response.from_json(Shape(co, gens, opts).whole(events), headers=policy_headers(*gens))
    await co.admit(gens[0], len(gens))  # 429 here, while a status can still be sent; the stream gives them back
    chunks = ClosingStream(_sse(co, gens, opts, ctx), lambda: co.release(len(gens)))
    return Response.from_stream(chunks, "text/event-stream; charset=utf-8", headers={**SSE_HEADERS,
                                                                                     **policy_headers(*gens)})


async def _all(runs) -> None:
    """Run the coroutines together; the first failure (or a cancellation) cancels the rest, and is raised."""
    tasks = [asyncio.ensure_future(r) for r in runs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _sse(co: Coordinator, gens: list[Generation], opts: Options, ctx) -> AsyncIterator[bytes]:
    shape = Shape(co, gens, opts)
    failed: list[BaseException] = []
    streams = [_choice_sse(co, shape, i, gen, ctx, failed) for i, gen in enumerate(gens)]
    source = streams[0] if len(streams) == 1 else _interleave(streams)
    async with contextlib.aclosing(source):  # a client that leaves closes this, and so every choice's events
        async for chunk in source:
            yield chunk
    if opts.include_usage and not failed:
        yield sse(shape.usage_chunk())
    yield SSE_DONE


async def _choice_sse(co: Coordinator, shape: Shape, i: int, gen: Generation, ctx,
                      failed: list[BaseException]) -> AsyncIterator[bytes]:
    """Choice i's events; a failure is reported as an error event (the status line is out) and noted in failed."""
    want_lp = gen.logprobs is not None
    if shape.opts.chat:
        yield sse(shape.chunk(i, None, role=True))
    events = co.events(gen, ctx)
    calls = ToolStream(shape.opts.tools) if shape.opts.tools else None
    try:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                text = ev.text if calls is None else calls.feed(ev.text)
                if text or want_lp:
                    yield sse(shape.chunk(i, text, events=[ev] if want_lp else ()))
            elif isinstance(ev, FinishEvent) and calls is not None:
                rest, made = calls.finish_with(ev.text)
                if rest:
                    yield sse(shape.chunk(i, rest))
                for k, call in enumerate(made):
                    yield sse(shape.chunk(i, None, tool_call=(k, call)))
                yield sse(shape.chunk(i, None, "tool_calls" if made else ev.reason))
            elif isinstance(ev, FinishEvent):
                if ev.text and shape.opts.chat:
                    yield sse(shape.chunk(i, ev.text))
                    yield sse(shape.chunk(i, None, ev.reason))
                else:
                    yield sse(shape.chunk(i, ev.text, ev.reason))
    except Exception as e:  # noqa: BLE001 - the status line is out: report the failure in the stream
        log.warning("stream %s failed: %s: %s", gen.request_id, type(e).__name__, e)
        failed.append(e)
        yield sse(openai_error_body(e, status_for(e)))
    finally:
        await events.aclose()  # runs events()' finally at once (KV release), whoever stopped the stream


async def _interleave(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The items of several streams as each comes; closing this closes them all."""
    pending = {asyncio.ensure_future(s.__anext__()): s for s in streams}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                stream = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                yield item
                pending[asyncio.ensure_future(stream.__anext__())] = stream
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


# ---------------------------------------------------------------- models


def model_card(co: Coordinator) -> dict:
    return {"id": co.model_id, "object": "model", "created": co.created, "owned_by": "knot-cluster",
            "context_length": co.cfg.context_length, "knot_digest": co.knot_digest,
            "memory": memory_report(co.station_memory), "prompt_cache": prompt_cache_report(co),
            "replicas": replica_report(co.pipeline)}


def replica_report(pipeline) -> dict:
    """Per station and shard, each replica's binding, whether the coordinator takes it to be up and
    the generations pinned to it (services/coordinator/pipeline.py)."""
    return {rs.name: [{"binding": r.binding, "up": r.state.down_since is None, "generations": r.load}
                      for r in rs.replicas] for rs in pipeline.sets()}


def memory_report(plans: list[dict | None]) -> dict:
    """The stations' memory profile and how much of their layers stays resident (their boot-time plans)."""
    profiles = {p["profile"] for p in plans if p}
    keys = ("budget_bytes", "layer_bytes", "fits", "resident_fraction", "streamed_bytes_per_token")
    return {"profile": profiles.pop() if len(profiles) == 1 else "mixed" if profiles else "unknown",
            "stations": [{"station": i, **({k: p[k] for k in keys} if p else {"unknown": True})}
                         for i, p in enumerate(plans)]}


def prompt_cache_report(co: Coordinator) -> dict:
    """Whether prompts reuse the stations' cached blocks, and each station's part: a station that
    cannot hold a block (a fluid one: its budget streams its layers) turns it off, and says why."""
    return {"on": co.engine.prompt_caching, "block_tokens": PREFIX_BLOCK_TOKENS,
            "stations": [{"station": i, **({k: p.get(k) for k in ("holds", "capacity_bytes", "why_not")}
                                           if p else {"unknown": True})}
                         for i, p in enumerate(co.station_prefix)]}


def models(co: Coordinator) -> Response:
    return Response.from_json({"object": "list", "data": [model_card(co)]})
