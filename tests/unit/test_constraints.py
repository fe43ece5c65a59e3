"""Constrained decoding's requests (common/constraints.py, deploy/llguidance_engine.py): what the
coordinator refuses, with a 400 naming the field, before any token; and the grammar of required
tool calls. The outputs themselves are tested on the real model (tests/realmodel, the schemas
validated and equal to the single process) and on random masks (tests/unit/test_rows.py)."""
from __future__ import annotations

import json

import pytest

from common import constraints
from common.runtime import Request
from deploy.llguidance_engine import tool_calls_lark
from services.coordinator.openai_api import response_format
from services.coordinator.errors import InvalidParam
from tests.inprocess import build_cluster


async def post(c, body: dict):
    return await c.coordinator.fetch(Request("POST", "https://coordinator/v1/chat/completions",
                                             {"Content-Type": "application/json"}, json.dumps(body).encode()))


MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("fmt, needle", [
    ({"type": "xml"}, 'the type must be "text", "json_object" or "json_schema"'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema must be"),
    ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema must be"),
])
def test_a_malformed_response_format_is_a_400(fmt, needle):
    with pytest.raises(InvalidParam, match=needle):
        response_format(fmt)


async def test_the_coordinator_refuses_what_it_cannot_constrain(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    try:
        big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200}
                                                for i in range(400)}}
        r = await post(c, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
            "name": "big", "schema": big}}})
        assert r.status == 400 and "bytes; at most" in r.json()["error"]["message"], r.body
        r = await post(c, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}})
        err = r.json()["error"]
        assert r.status == 400 and err["param"] == "response_format" and "does not compile" in err["message"], err
        r = await post(c, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
                           "tool_choice": "required", "response_format": {"type": "json_object"}})
        assert r.status == 400 and "cannot both be met" in r.json()["error"]["message"]
        # where no engine is installed (the Cloudflare Workers): a 400 that says so, naming the field
        installed = constraints.compiler()
        constraints.install(None)
        try:
            r = await post(c, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
                               "tool_choice": "required"})
            err = r.json()["error"]
            assert r.status == 400 and err["param"] == "tool_choice" and "not available on this host" in \
                err["message"], err
        finally:
            constraints.install(installed)
    finally:
        await c.drain()


def test_the_tool_calls_grammar_names_the_call_tokens_and_each_functions_schema():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    one = tool_calls_lark({"get_weather": schema}, False, (151657, 151658))
    assert one.startswith("start: call\n") and '<[151657]> "\\n" body "\\n" <[151658]>' in one
    body = json.loads(one.split("%json ", 1)[1])
    assert body["anyOf"][0]["properties"] == {"name": {"const": "get_weather"}, "arguments": schema}
    assert tool_calls_lark({"f": schema}, True, (1, 2)).startswith('start: call ("\\n" call)*\n')


def test_a_constraint_follows_drafts_forward_and_back(tiny_knot):
    """allowed(seq) for a trip's rows: drafts inside the grammar move the matcher on, a rejected
    one rolls it back, and one outside the grammar neither breaks it nor needs a mask after it."""
    from common.constraints import Grammar
    from deploy.engine_local import LocalEngine

    engine = LocalEngine.open(tiny_knot)
    tok, vocab = engine.tokenizer, engine.cfg.vocab_size
    compiled = constraints.compiler().compile(Grammar("json_schema", json.dumps({"type": "object"})), tok, vocab)
    prompt = tok.encode("x", False)
    con = compiled.start(len(prompt))
    first = con.allowed(prompt)
    opening = [i for i in map(int, first.nonzero()[0])]
    assert opening and all(tok.decode([i]).startswith("{") for i in opening)
    bad = next(i for i in range(vocab) if not first[i])
    assert con.allowed(prompt + [opening[0], bad]) is None  # a draft outside: no row after it is sampled
    again = con.allowed(prompt)  # rolled back to the start: the same mask
    assert (again == first).all()
    later = con.allowed(prompt + [opening[0]])
    assert later is not None and later.any() and not (later == first).all()
