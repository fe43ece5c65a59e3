"""Request bodies -> GenerateRequest, every bad field a 400 that names it.

parse_generate() reads POST /generate; the field readers below are shared with the OpenAI
endpoints (services/coordinator/openai_api.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from common.constraints import Grammar
from common.sampling import SamplingParams
from common.speculative import MAX_DRAFT, SOURCES
from services.coordinator.errors import InvalidParam
from services.coordinator.tools import ToolRequest, template_calls

DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class SpeculationRequest:
    """What a request asks of speculative decoding; "auto" and None leave it to the server."""

    source: str = "auto"  # "auto" or one of common.speculative.SOURCES
    max_draft: int | None = None


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int | None  # None: up to the context length
    sampling: SamplingParams
    stop: tuple[str, ...]
    prompt_ids: tuple[int, ...] | None = None  # a prompt given as token ids (OpenAI completions)
    logprobs: int | None = None  # alternatives reported per token; None: no logprobs at all
    speculation: SpeculationRequest = field(default_factory=SpeculationRequest)
    shard_failure: str | None = None  # "fail" | "degrade"; None: the cluster's SHARD_FAILURE
    suffix: str | None = None  # fill in the middle: the text after the one to write (prompt is before it)
    tools: ToolRequest | None = None  # chat's tools, tool_choice and parallel_tool_calls
    grammar: Grammar | None = None  # what the reply must match (constrained decoding)
    grammar_param: str = "response_format"  # the field that asked for it, named in its 400s
    cache_prompt: bool = True  # may reuse the stations' cached blocks of its prompt (the tokens are the same)


def number(body: dict, name: str, default: Any, lo: float | None = None, hi: float | None = None,
           integer: bool = False) -> Any:
    """body[name] as a number (JSON null = absent); booleans are not numbers."""
    v = body.get(name, default)
    if v is None:
        v = default
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise InvalidParam(f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}", name)
    # Python's json reads NaN, Infinity and -Infinity; every comparison with NaN is False, so a
    # range check alone would let it through into the sampler.
    if isinstance(v, float) and not math.isfinite(v):
        raise InvalidParam(f"{name} must be a finite number, got {v!r}", name)
    if lo is not None and v < lo:
        raise InvalidParam(f"{name} must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise InvalidParam(f"{name} must be <= {hi}, got {v}", name)
    return v


# Stop strings are matched on the coordinator's one event loop at every token, for every request at
# once: a few well-formed ones are what clients send (OpenAI takes 4), and a megabyte of them is not.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidParam("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidParam(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    for s in stop:
        if len(s) > MAX_STOP_CHARS:
            raise InvalidParam(f"a stop string takes at most {MAX_STOP_CHARS} characters, got one of {len(s)}",
                               "stop")
    return tuple(stop)


MAX_SEED = 2 ** 64 - 1  # a seed is an unsigned 64-bit number, as in llama.cpp


def sampling_params(body: dict) -> SamplingParams:
    """The sampling fields, each checked here (a 400 naming it) before SamplingParams sees it."""
    top_k = number(body, "top_k", 0, lo=-1, integer=True)  # -1 = off, as vLLM spells it
    top_p = float(number(body, "top_p", 1.0, lo=0, hi=1))
    if top_p == 0:
        raise InvalidParam("top_p must be > 0 (it keeps the smallest set of tokens whose probability "
                           "reaches top_p; use temperature 0 for greedy)", "top_p")
    return SamplingParams(
        temperature=float(number(body, "temperature", 0.0, lo=0)),
        top_k=max(top_k, 0),
        top_p=top_p,
        min_p=float(number(body, "min_p", 0.0, lo=0, hi=1)),
        repetition_penalty=float(number(body, "repetition_penalty", 1.0, lo=1e-6)),
        presence_penalty=float(number(body, "presence_penalty", 0.0, lo=-2, hi=2)),
        frequency_penalty=float(number(body, "frequency_penalty", 0.0, lo=-2, hi=2)),
        seed=number(body, "seed", None, lo=0, hi=MAX_SEED, integer=True),
        logit_bias=logit_bias(body),
    )


MAX_LOGIT_BIAS = 1024  # ids one request may bias (a bound of ours: each costs the sampler on every token)
LOGIT_BIAS_RANGE = 100  # each bias in [-100, 100], OpenAI's range


def logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """body["logit_bias"]: {"token id": bias in [-100, 100]}, OpenAI's shape (JSON keys are strings)
    -> ((id, bias), ...) ascending. Each bias is added to its token's logit before the penalties, as
    llama.cpp does: -100 all but bans a token. The vocabulary's bound is the coordinator's check
    (Coordinator.prepare)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise InvalidParam('logit_bias must be an object {"token id": bias}', "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise InvalidParam(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(v)}", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        tid = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if tid is None or tid in out:
            raise InvalidParam(f"logit_bias: {key!r} is not a token id (a non-negative integer, once)", "logit_bias")
        try:
            out[tid] = float(number({"b": bias}, "b", None, lo=-LOGIT_BIAS_RANGE, hi=LOGIT_BIAS_RANGE))
        except (InvalidParam, TypeError):  # TypeError: null
            raise InvalidParam(f"logit_bias[{key!r}] must be a number in [-{LOGIT_BIAS_RANGE}, "
                               f"{LOGIT_BIAS_RANGE}], got {bias!r}", "logit_bias") from None
    return tuple(sorted(out.items()))


def speculation_request(body: dict) -> SpeculationRequest:
    """body["speculation"]: a source ("auto", "off", "prompt_lookup", "draft_model"), or
    {"source": ..., "max_draft": n}; absent or null: the server's choice."""
    v = body.get("speculation")
    if v is None:
        return SpeculationRequest()
    if isinstance(v, str):
        v = {"source": v}
    if not isinstance(v, dict) or set(v) - {"source", "max_draft"}:
        raise InvalidParam('speculation must be a source name or {"source": ..., "max_draft": n}', "speculation")
    source = v.get("source") or "auto"
    if source not in ("auto", *SOURCES):
        raise InvalidParam(f"speculation source {source!r}: expected one of auto, {', '.join(SOURCES)}",
                           "speculation")
    max_draft = number(v, "max_draft", None, lo=1, hi=MAX_DRAFT, integer=True)
    return SpeculationRequest(source, max_draft)


def fim_suffix(body: dict, text_prompt: bool) -> str | None:
    """body["suffix"]: fill in the middle, between the prompt and this text (absent or null: a plain
    completion). It needs a prompt as text; the coordinator refuses it for a model without the
    fill-in-the-middle tokens."""
    v = body.get("suffix")
    if v is None:
        return None
    if not isinstance(v, str):
        raise InvalidParam(f"suffix must be a string, got {type(v).__name__}", "suffix")
    if not text_prompt:
        raise InvalidParam("suffix needs a prompt given as text (fill in the middle between prompt and suffix)",
                           "suffix")
    return v


def cache_prompt(body: dict) -> bool:
    """cache_prompt (llama-server's name): false makes the prompt run from position 0 whatever the
    stations keep, as a cold request would (its blocks are still kept for the next one)."""
    v = body.get("cache_prompt")
    if v is None:  # absent or JSON null: the default
        return True
    if not isinstance(v, bool):
        raise InvalidParam(f"cache_prompt must be true or false, got {v!r}", "cache_prompt")
    return v


SHARD_FAILURE_POLICIES = ("fail", "degrade")  # services/coordinator/pipeline.py says what each does


def shard_failure(body: dict) -> str | None:
    """The request's own shard-failure policy (absent or null: the cluster's)."""
    v = body.get("shard_failure")
    if v is not None and v not in SHARD_FAILURE_POLICIES:
        raise InvalidParam(f"shard_failure must be one of {', '.join(SHARD_FAILURE_POLICIES)}, got {v!r}",
                           "shard_failure")
    return v


# The roles Qwen's chat template renders. Why refuse the rest: the template drops a message whose
# role it does not know, in silence ("usr" would leave the model answering without the question),
# and a role is template text, so "user<|im_end|>..." would write control tokens where only the
# contents are kept as plain text (common/tokenizer.py, encode_chat).
CHAT_ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer name for the system role, which its recent SDKs send: the template gets "system".
ROLE_ALIASES = {"developer": "system"}


def chat_message(m: dict, i: int, content: str, tool_calls: bool = False) -> dict:
    """messages[i] as the template gets it: its role, checked, and `content`; with tool_calls (the
    OpenAI chat endpoint), an assistant's earlier `tool_calls` too (services/coordinator/tools.py;
    the template writes their names as its own text, and encode_chat refuses control text there).
    Other keys (`name`, `tool_call_id`, ...) do not reach it."""
    role = ROLE_ALIASES.get(m.get("role"), m.get("role"))
    if role not in CHAT_ROLES:
        raise InvalidParam(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)} (or developer, read as "
                           f"system), got {m.get('role')!r}", "messages")
    if m.get("function_call"):
        raise InvalidParam(f"messages[{i}].function_call: the legacy functions API is not supported (send "
                           f"tool_calls)", "messages")
    if m.get("tool_calls"):
        if not tool_calls:
            raise InvalidParam(f"messages[{i}].tool_calls: no tool calling on this endpoint (use "
                               f"/v1/chat/completions)", "messages")
        if role != "assistant":
            raise InvalidParam(f"messages[{i}].tool_calls: only an assistant message has tool calls", "messages")
        return {"role": role, "content": content, "tool_calls": template_calls(m, i)}
    return {"role": role, "content": content}


def check_messages(messages: Any, param: str = "messages") -> list[dict]:
    """POST /generate's messages: each exactly {"role", "content"}, both strings (the project's own
    endpoint refuses what it would not read, as it does for fields)."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise InvalidParam('messages must be a non-empty list of {"role": str, "content": str}', param)
    out = []
    for i, m in enumerate(messages):
        out.append(chat_message(m, i, m["content"]))
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise InvalidParam(f"messages[{i}] takes only role and content, got {', '.join(map(repr, extra))}", param)
    return out


# What POST /generate reads. Why it refuses the rest, unlike the OpenAI endpoints (which ignore
# fields such as `user`, as OpenAI's clients send them): this endpoint is the project's own, and a
# misspelt field ("max_token", "temprature") or one only the OpenAI endpoints serve ("logprobs")
# would otherwise be dropped in silence, and the reply would answer another request.
GENERATE_FIELDS = ("prompt", "messages", "max_tokens", "temperature", "top_k", "top_p", "min_p",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
                   "speculation", "shard_failure", "suffix", "logit_bias", "cache_prompt")
OPENAI_ONLY = {"logprobs": "/v1/completions or /v1/chat/completions", "top_logprobs": "/v1/chat/completions",
               "stream": "/v1/completions or /v1/chat/completions", "model": "/v1/completions or /v1/chat/completions",
               "n": "/v1/completions or /v1/chat/completions"}


def parse_generate(body: Any) -> GenerateRequest:
    if not isinstance(body, dict):
        raise InvalidParam("the body must be a JSON object")
    unknown = [k for k in body if k not in GENERATE_FIELDS]
    if unknown:
        k = unknown[0]
        where = f"; {k!r} is served by {OPENAI_ONLY[k]}" if k in OPENAI_ONLY else ""
        raise InvalidParam(f"POST /generate does not take {', '.join(map(repr, unknown))}{where} "
                           f"(its fields: {', '.join(GENERATE_FIELDS)})", k)
    prompt, messages, suffix = _prompt_fields(body)
    max_tokens = number(body, "max_tokens", DEFAULT_MAX_TOKENS, lo=1, integer=True)
    return GenerateRequest(prompt, messages, max_tokens, sampling_params(body), stop_strings(body),
                           speculation=speculation_request(body), shard_failure=shard_failure(body), suffix=suffix,
                           cache_prompt=cache_prompt(body))


def _prompt_fields(body: dict) -> tuple[str | None, list[dict] | None, str | None]:
    """/generate's and /tokenize's prompt: exactly one of prompt (a string, with an optional suffix)
    and messages -> (prompt, messages, suffix)."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise InvalidParam('give exactly one of "prompt" (a string) or "messages" (a list of {role, content})')
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidParam(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
    if messages is not None:
        messages = check_messages(messages)
    return prompt, messages, fim_suffix(body, prompt is not None)


TOKENIZE_FIELDS = ("prompt", "messages", "suffix", "add_generation_prompt")


def parse_tokenize(body: Any) -> tuple[GenerateRequest, bool]:
    """POST /tokenize: the prompt of a /generate body (prompt, or messages; suffix with prompt) and
    add_generation_prompt (a chat's assistant header, default true) -> (the request, that flag)."""
    if not isinstance(body, dict):
        raise InvalidParam("the body must be a JSON object")
    unknown = [k for k in body if k not in TOKENIZE_FIELDS]
    if unknown:
        raise InvalidParam(f"POST /tokenize does not take {', '.join(map(repr, unknown))} "
                           f"(its fields: {', '.join(TOKENIZE_FIELDS)})", unknown[0])
    prompt, messages, suffix = _prompt_fields(body)
    gen_prompt = body.get("add_generation_prompt", True)
    if not isinstance(gen_prompt, bool):
        raise InvalidParam(f"add_generation_prompt must be a boolean, got {gen_prompt!r}", "add_generation_prompt")
    return GenerateRequest(prompt, messages, None, SamplingParams(), (), suffix=suffix), gen_prompt


def parse_detokenize(body: Any, vocab_size: int, max_tokens: int) -> list[int]:
    """POST /detokenize: {"tokens": [ids]}, at most max_tokens of them (the context's), each in the vocabulary."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(body, dict) or set(body) != {"tokens"} or not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidParam('POST /detokenize takes {"tokens": [token ids]}', "tokens")
    if len(tokens) > max_tokens:
        raise InvalidParam(f"tokens: at most {max_tokens} ids (the context length), got {len(tokens)}", "tokens")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidParam(f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab_size})", "tokens")
    return tokens
