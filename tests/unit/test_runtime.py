"""The handler contract in common/runtime.py."""
import json

import pytest

from common import runtime as rt
from common.runtime import Env, Headers, Request, Response


def test_headers_are_case_insensitive_and_keep_spelling():
    h = Headers({"Content-Type": "a"})
    h["content-type"] = "b"
    h["X-Knot-Id"] = "k"
    assert h["CONTENT-TYPE"] == "b" and h.get("x-knot-id") == "k" and "X-KNOT-ID" in h
    assert dict(h.items()) == {"content-type": "b", "X-Knot-Id": "k"}
    del h["x-knot-id"]
    assert len(h) == 1


def test_request_path_query_json():
    r = Request("post", "http://w/tensors?a=1&b=&a=2", {"X-A": "1"}, b'{"names": ["x"]}')
    assert (r.method, r.path, r.query) == ("POST", "/tensors", {"a": "2", "b": ""})
    assert r.json() == {"names": ["x"]} and r.headers["x-a"] == "1"
    assert Request("GET", "/").path == "/"
    with pytest.raises(rt.BadRequest, match="not JSON: Expecting value at byte 0"):
        Request("POST", "/", body=b"nope").json()
    with pytest.raises(rt.BadRequest, match="empty"):
        Request("POST", "/").json()


def test_response_constructors():
    r = Response.from_json({"a": 1}, status=201)
    assert (r.status, r.headers["content-type"], r.json()) == (201, "application/json", {"a": 1})
    assert Response.from_text("hi").text() == "hi"
    b = Response.from_bytes(b"\x00\x01", "application/x-knot-tensor")
    assert b.body == b"\x00\x01" and b.headers["Content-Type"] == "application/x-knot-tensor" and b.ok


def test_a_body_given_as_parts_is_their_concatenation_joined_only_when_read():
    data = bytes(range(256)) * 10
    parts = [data[:5], memoryview(data)[5:300].toreadonly(), b"", data[300:]]
    r = Response.from_parts(parts, "application/x-knot-tensor-batch")
    assert r.headers["Content-Type"] == "application/x-knot-tensor-batch" and r.nbytes == len(data)
    assert r.parts[1].obj is data, "kept as given, not copied"
    assert r.body == data and r.parts == (data,), "read once, joined once"
    assert r == Response.from_bytes(data, "application/x-knot-tensor-batch") and "nbytes=2560" in repr(r)
    assert Response.from_bytes(b"xy").parts == (b"xy",) and Response.from_bytes(b"xy").nbytes == 2
    r.body = b"new"
    assert (r.body, r.parts, r.nbytes) == (b"new", (b"new",), 3)
    with pytest.raises(TypeError, match="read-only and contiguous"):
        Response.from_parts([memoryview(bytearray(4))])  # a buffer its owner could still change
    with pytest.raises(TypeError, match="read-only and contiguous"):
        Response.from_parts([memoryview(data)[::2]])


@pytest.mark.parametrize("exc, status", [
    (rt.BadRequest("x"), 400), (rt.NotFound("x"), 404), (rt.Conflict("x"), 409),
    (rt.RangeNotSatisfiable("x"), 416), (rt.BadGateway("x"), 502), (rt.ServiceUnavailable("x"), 503),
    (rt.GatewayTimeout("x"), 504), (TimeoutError(), 504), (KeyError("k"), 500), (ValueError("v"), 500),
])
def test_one_mapping_from_errors_to_status(exc, status):
    r = rt.error_response(exc, "rid1")
    assert r.status == status
    body = r.json()
    assert body["error"] == type(exc).__name__ and body["request_id"] == "rid1" and body["message"]


def test_raise_for_status_maps_peer_replies():
    rt.raise_for_status(Response(204), "peer")
    with pytest.raises(rt.NotFound, match="peer: HTTP 404: gone"):
        rt.raise_for_status(Response.from_json({"message": "gone"}, status=404), "peer")
    with pytest.raises(rt.BadGateway, match="HTTP 500"):
        rt.raise_for_status(Response(500, body=b"boom"), "peer")


async def test_call_handler_turns_every_exception_into_a_response():
    async def boom(request, env, ctx):
        raise rt.Conflict("already configured as k|0-1")

    async def wrong(request, env, ctx):
        return {"not": "a response"}

    r = await rt.call_handler(boom, Request("GET", "/"), Env(), None, "r1")
    assert r.status == 409 and r.json()["message"] == "already configured as k|0-1"
    r = await rt.call_handler(wrong, Request("GET", "/"), Env(), None)
    assert r.status == 500 and "returned dict" in r.json()["message"]


def test_env_attribute_access_names_what_is_missing():
    env = Env({"KNOT_BUCKET": object()}, {"MEMORY_BUDGET_BYTES": "10"})
    assert env.MEMORY_BUDGET_BYTES == "10" and "KNOT_BUCKET" in env and env.get("NOPE", 3) == 3
    with pytest.raises(AttributeError, match="EMBED_CACHE.*KNOT_BUCKET, MEMORY_BUDGET_BYTES"):
        env.EMBED_CACHE


def test_int_param():
    assert rt.int_param("12", "X-Layer-End") == 12
    with pytest.raises(rt.BadRequest, match="X-Layer-End must be an integer, got 'a'"):
        rt.int_param("a", "X-Layer-End")
    with pytest.raises(rt.BadRequest, match="X-Layer-End is missing"):
        rt.int_param(None, "X-Layer-End")
    with pytest.raises(rt.BadRequest, match=">= 0, got -1"):
        rt.int_param("-1", "row")


def test_json_body_roundtrip_through_request():
    body = json.dumps({"knot_key": "k"}).encode()
    assert Request("POST", "/configure", body=body).with_url("/x").json() == {"knot_key": "k"}
