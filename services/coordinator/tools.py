"""Tool calling on /v1/chat/completions (docs/api.md, "Tool calls"), in the model's own format.

Qwen2.5-Coder's chat template lists the request's `tools` in the system turn and asks for each
call as a JSON object between <tool_call> and </tool_call> (both single tokens of its vocabulary);
it writes an assistant's earlier `tool_calls` the same way and wraps `tool` replies in
<tool_response>. This module is the part around the template:

    parse_tools(body)            the request's tools, tool_choice and parallel_tool_calls, checked
    template_message(m, i, ...)  an assistant's tool_calls / a tool reply as the template reads them
    split_calls(text, tools)     a finished text -> (content, calls), or None: it stays text
    ToolStream                   the same while streaming: content as it comes, calls at the end

A text that is not a valid call (broken JSON, an unknown function, arguments that are not an
object) stays text with its own finish_reason, never dropped: in "auto" mode the model may write
anything. "required" and a named function are constrained (ToolRequest.grammar, through
common/constraints.py), so there the calls always parse and match their functions' schemas.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from common.constraints import Grammar
from services.coordinator.errors import InvalidParam

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's function names: a-z, A-Z, 0-9, _ and -, <= 64


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]  # OpenAI's {"type": "function", "function": {name, description, parameters}}
    choice: str  # "auto" | "none" | "required" | "function"
    name: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: more than one call per reply

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def rendered(self) -> list[dict] | None:
        """What the template lists: none for tool_choice "none", so the model is not offered them."""
        return None if self.choice == "none" else list(self.tools)

    def schema(self, name: str) -> dict:
        return next(t["function"].get("parameters") or {"type": "object"} for t in self.tools
                    if t["function"]["name"] == name)

    def grammar(self) -> Grammar:
        """A reply of calls in the template's format, their arguments each function's schema: of
        the named function, or of any of the tools ("required"); several where parallel."""
        names = [self.name] if self.choice == "function" else self.names
        return Grammar("tool_calls", json.dumps({n: self.schema(n) for n in names}), self.parallel)


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools; None where it has none. A 400 naming the field for anything malformed."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidParam(f"parallel_tool_calls must be a boolean, got {parallel!r}", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidParam(f"tool_choice={choice!r} needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidParam("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    checked, seen = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise InvalidParam(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidParam(f"tools[{i}].function.name must be 1 to 64 of a-z, A-Z, 0-9, _, ., : and -, got "
                               f"{name!r}", "tools")
        if name in seen:
            raise InvalidParam(f"tools[{i}].function.name {name!r} is given twice", "tools")
        seen.add(name)
        desc, params = f.get("description"), f.get("parameters")
        if desc is not None and not isinstance(desc, str):
            raise InvalidParam(f"tools[{i}].function.description must be a string", "tools")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise InvalidParam(f"tools[{i}].function.parameters must be a JSON schema of an object", "tools")
        strict = f.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidParam(f"tools[{i}].function.strict must be a boolean", "tools")
        fn = {"name": name, **({"description": desc} if desc is not None else {}),
              **({"parameters": params} if params is not None else {})}
        checked.append({"type": "function", "function": fn})
    req = ToolRequest(tuple(checked), "auto", None, True if parallel is None else parallel)
    if choice is None or choice in ("auto", "none", "required"):
        return ToolRequest(req.tools, choice or "auto", None, req.parallel)
    if (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        if name not in seen:
            raise InvalidParam(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return ToolRequest(req.tools, "function", name, req.parallel)
    raise InvalidParam(f"tool_choice must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")


def template_calls(m: dict, i: int) -> list[dict]:
    """messages[i].tool_calls (an assistant's earlier calls) as the template writes them: the
    arguments as an object (OpenAI sends them as a JSON string; the template's tojson would quote
    a string again)."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise InvalidParam(f"messages[{i}].tool_calls must be a non-empty list", "messages")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and _NAME.fullmatch(f["name"])):
            raise InvalidParam(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                               f"{{\"name\", \"arguments\"}}}} with a function name", "messages")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise InvalidParam(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}",
                                   "messages") from None
        if not isinstance(args, dict):
            raise InvalidParam(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object",
                               "messages")
        out.append({"type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def _call(obj: Any, tools: ToolRequest) -> dict | None:
    """One block's JSON as an OpenAI tool call, or None where it is not a call of one of the tools."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"] in tools.names):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some fine-tunes write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def split_calls(text: str, tools: ToolRequest) -> tuple[str, list[dict]] | None:
    """A reply's text -> (the content before its first call, the calls), or None where the text
    holds no call or any of its blocks is not a valid call (then all of it stays text): a block
    cut off (max_tokens) before its </tool_call> too. Besides the template's <tool_call> blocks,
    a reply that is nothing but call objects ({"name", "arguments"}, one, several or a list,
    bare or in one ```json fence) is calls: what the small Qwen2.5-Coder models write when
    offered tools, and what llama.cpp's parser of this format accepts too."""
    if tools.choice == "none":
        return None
    start = text.find(CALL_OPEN)
    if start < 0:
        calls = _bare_calls(text, tools)
        return None if calls is None else ("", calls)
    head, rest = text[:start], text[start:]
    calls = []
    pos = 0
    for m in _BLOCK.finditer(rest):
        if rest[pos:m.start()].strip():  # text between calls: not a reply of calls only
            return None
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return None
        call = _call(obj, tools)
        if call is None:
            return None
        calls.append(call)
        pos = m.end()
    if not calls or rest[pos:].strip():
        return None
    if not tools.parallel and len(calls) > 1:
        return None
    return head.rstrip("\n") if head.strip() else "", calls


_FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.S)


def _bare_calls(text: str, tools: ToolRequest) -> list[dict] | None:
    body = text.strip()
    fenced = _FENCE.fullmatch(body)
    if fenced:
        body = fenced.group(1).strip()
    if not body.startswith(("{", "[")):
        return None
    objs, pos, decoder = [], 0, json.JSONDecoder()
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        objs.extend(obj if isinstance(obj, list) else [obj])
        while pos < len(body) and body[pos] in " \t\r\n":
            pos += 1
    calls = [_call(o, tools) for o in objs]
    if not calls or None in calls or (not tools.parallel and len(calls) > 1):
        return None
    return calls


_BARE_OPENINGS = ("{", "[", "```json", CALL_OPEN)


class ToolStream:
    """A streamed reply's content as it comes, up to the first <tool_call>; from there it is held
    until the end decides: calls (finish_reason "tool_calls") or, if they do not parse, the held
    text as content after all. A tail that could begin the marker waits for the next piece."""

    def __init__(self, tools: ToolRequest):
        self.tools, self.text, self.sent, self.held_from = tools, "", 0, None

    def feed(self, piece: str) -> str:
        """The content to send now for this piece of text."""
        self.text += piece
        if self.held_from is not None:
            return ""
        if self.tools.choice == "none":
            upto = len(self.text)
        elif self.sent == 0 and (lead := self.text.lstrip()) and lead.startswith(_BARE_OPENINGS):
            self.held_from = upto = 0  # maybe a reply of bare call objects: held to the end
        elif self.sent == 0 and any(o.startswith(self.text.lstrip()) for o in _BARE_OPENINGS):
            upto = 0  # too little to tell yet
        else:
            at = self.text.find(CALL_OPEN, max(0, self.sent - len(CALL_OPEN)))
            if at >= 0:
                self.held_from = upto = at
            else:  # the longest tail that is a beginning of the marker
                upto = len(self.text) - next((k for k in range(min(len(CALL_OPEN) - 1, len(self.text)), 0, -1)
                                              if CALL_OPEN.startswith(self.text[-k:])), 0)
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out

    def finish_with(self, last: str) -> tuple[str, list[dict]]:
        """The end, with the last piece of text (the stream's finish event's): (content still to
        send, calls), the calls where the held text parses, else all the text not sent yet."""
        now = self.feed(last)
        split = split_calls(self.text, self.tools) if self.held_from is not None else None
        if split is None:
            now, self.sent = now + self.text[self.sent:], len(self.text)
            return now, []
        return now, split[1]
