"""POST /generate body -> GenerateRequest, every bad field a 400 that names it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.runtime import BadRequest
from common.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]


def _number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
            integer: bool = False) -> Any:
    v = body.get(name, default)
    if v is None:
        v = default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise BadRequest(f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if lo is not None and v < lo:
        raise BadRequest(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise BadRequest(f"{name} must be <= {hi}, got {v}")
    return v


def parse_generate(body: Any) -> GenerateRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest('give exactly one of "prompt" (a string) or "messages" (a list of {role, content})')
    if prompt is not None and not isinstance(prompt, str):
        raise BadRequest(f"prompt must be a string, got {type(prompt).__name__}")
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise BadRequest("messages must be a non-empty list of {\"role\": str, \"content\": str}")
    max_tokens = _number(body, "max_tokens", DEFAULT_MAX_TOKENS, lo=1, integer=True)
    stop = body.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a string or a list of strings")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"seed must be an integer, got {seed!r}")
    sampling = SamplingParams(
        temperature=float(_number(body, "temperature", 0.0, lo=0)),
        top_k=_number(body, "top_k", 0, lo=0, integer=True),
        top_p=float(_number(body, "top_p", 1.0, lo=0, hi=1)),
        min_p=float(_number(body, "min_p", 0.0, lo=0, hi=1)),
        repetition_penalty=float(_number(body, "repetition_penalty", 1.0, lo=1e-6)),
        presence_penalty=float(_number(body, "presence_penalty", 0.0, lo=-2, hi=2)),
        frequency_penalty=float(_number(body, "frequency_penalty", 0.0, lo=-2, hi=2)),
        seed=seed,
    )
    if sampling.top_p == 0:
        raise BadRequest("top_p must be > 0")
    return GenerateRequest(prompt, messages, max_tokens, sampling, tuple(stop))
