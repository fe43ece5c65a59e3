"""The coordinator never stalls (issue 12): huge bodies are refused before they are read, a prompt
too long by its characters alone before it is tokenized, tokenizing stops once a prompt exceeds the
context, and parsing and tokenizing run off the event loop, inline where threads do not exist."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings, strategies as st

from common import tokenizer as tokenizer_mod
from common.runtime import Env, Request, Response
from common.tokenizer import Tokenizer, TooManyTokens
from deploy.local.host import ServiceRuntime, build_app, load_service
from deploy.local.tasks import BackgroundTasks
from services import offload
from services.coordinator import handler as coordinator
from tests.inprocess import build_cluster
from tests.unit.test_tokenizer import SPECIALS, tiny_data


# ------------------------------------------------------------------ bodies over the limit


async def test_the_coordinator_refuses_a_body_over_its_limit_before_reading_it():
    """4 MiB for the public API (a 32k-token prompt is a few hundred KB); the handler never runs."""
    svc = load_service("services.coordinator")
    assert svc.max_body_bytes == coordinator.MAX_BODY_BYTES == 4 << 20
    assert load_service("services.station").max_body_bytes == 64 << 20, "internal frames: a chunk of hidden states"
    calls = []

    async def handler(request: Request, env, ctx) -> Response:
        calls.append(len(request.body))
        return Response.from_json({"ok": True})

    rt = ServiceRuntime("coordinator", handler, Env(), BackgroundTasks("test"), max_body_bytes=svc.max_body_bytes)
    async with TestClient(TestServer(build_app(rt))) as client:
        r = await client.post("/v1/completions", data=b"x" * (5 << 20))
        assert r.status == 413, await r.text()
        assert (await r.json())["error"] == "HTTPRequestEntityTooLarge"

        async def chunked():  # no Content-Length: refused once the limit is passed
            for _ in range(6):
                yield b"y" * (1 << 20)

        r = await client.post("/v1/completions", data=chunked())
        assert r.status == 413
        r = await client.post("/v1/completions", data=b"z" * 1000)
        assert r.status == 200
    assert calls == [1000]


# ------------------------------------------------------------------ bounded tokenization

TOK = Tokenizer(tiny_data())


PARTS = list("ab Z9\n\t \r.;'") + ["é", "字", "\n\n", "  \n", "the", " def", SPECIALS[1]]


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from(PARTS), max_size=120).map("".join), piece=st.integers(1, 40))
def test_encode_bounded_equals_encode_for_any_cut(text, piece):
    """Cut at safe points into pieces of any size, the ids are those of the whole text."""
    old = tokenizer_mod.ENCODE_PIECE_CHARS
    tokenizer_mod.ENCODE_PIECE_CHARS = piece
    try:
        for special in (True, False):
            assert TOK.encode_bounded(text, 10 ** 6, special) == TOK.encode(text, special)
    finally:
        tokenizer_mod.ENCODE_PIECE_CHARS = old


def test_encode_bounded_stops_after_about_the_limit(monkeypatch):
    monkeypatch.setattr(tokenizer_mod, "ENCODE_PIECE_CHARS", 100)
    seen = []
    encode = TOK.encode
    monkeypatch.setattr(TOK, "encode", lambda text, special=True: seen.append(len(text)) or encode(text, special))
    text = "abc def\n" * 10_000  # 80,000 characters
    with pytest.raises(TooManyTokens) as e:
        TOK.encode_bounded(text, 50)
    assert e.value.max_tokens == 50 and e.value.n_tokens > 50
    assert sum(seen) < 400, "encoded about the limit's worth, not 80,000 characters"
    with pytest.raises(TooManyTokens):
        TOK.encode_chat([{"role": "user", "content": text}], max_tokens=50)


@pytest.mark.realmodel
def test_encode_bounded_equals_encode_on_the_real_vocabulary(monkeypatch):
    from deploy.knotfile import open_model
    from deploy.models import knot_cache_path, model_path

    try:
        path = model_path("qwen2.5-coder-0.5b")
    except Exception as e:  # not fetched
        pytest.skip(f"qwen2.5-coder-0.5b not available: {e}")
    knot = knot_cache_path(path)
    tok = Tokenizer(open_model(knot if knot.is_file() else path).tokenizer_data())
    assert tok.max_token_bytes == 128  # a run of spaces
    text = open(tokenizer_mod.__file__, encoding="utf-8").read() * 3 + "\n  \n\tx\r\n字 é<|im_start|>\n" * 50
    monkeypatch.setattr(tokenizer_mod, "ENCODE_PIECE_CHARS", 97)
    assert tok.encode_bounded(text, 10 ** 6) == tok.encode(text)
    assert tok.encode_bounded(text, 10 ** 6, special=False) == tok.encode(text, special=False)


# ------------------------------------------------------------------ the coordinator's 400s


async def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(tiny_knot, tmp_path, monkeypatch):
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    co = await coordinator.coordinator_for(c.coordinator.env)
    longest = co.tokenizer.max_token_bytes
    calls = []
    monkeypatch.setattr(Tokenizer, "encode", lambda self, *a, **k: calls.append(1) or [])
    n = co.cfg.context_length * longest
    for body in ({"prompt": "x" * n}, {"messages": [{"role": "user", "content": "x" * n}]}):
        r = await c.generate(**body, max_tokens=1)
        assert r.status == 400, r.body
        msg = r.json()["message"]
        assert f"the prompt is {n} characters, so at least {co.cfg.context_length} tokens" in msg, msg
    assert calls == [], "refused without tokenizing"
    await c.drain()


async def test_a_prompt_of_more_tokens_than_the_context_stops_tokenizing_early(tiny_knot, tmp_path, monkeypatch):
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    co = await coordinator.coordinator_for(c.coordinator.env)
    monkeypatch.setattr(tokenizer_mod, "ENCODE_PIECE_CHARS", 64)
    seen = []
    encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, special=True: seen.append(len(text)) or
                        encode(self, text, special))
    prompt = "the\n" * 800  # 3,200 characters, 1,600 tokens: past the 256-token context
    r = await c.generate(prompt=prompt, max_tokens=1)
    assert r.status == 400 and "more than 255 tokens" in r.json()["message"], r.body
    assert sum(seen) < 1000, "tokenized about the context's worth of the prompt"
    await c.drain()


# ------------------------------------------------------------------ off the event loop


async def test_tokenizing_runs_off_the_event_loop(tiny_knot, tmp_path, monkeypatch):
    """A tokenization that takes long does not hold /v1/models up: the slow encode waits for
    /v1/models to have answered (with a deadline, so the old inline code fails instead of hanging)."""
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    await coordinator.coordinator_for(c.coordinator.env)
    answered = threading.Event()
    order = []
    encode = Tokenizer.encode

    def slow_encode(self, text, special=True):
        order.append("encode waits")
        ok = answered.wait(5)
        order.append("encode done" if ok else "encode gave up")
        return encode(self, text, special)

    monkeypatch.setattr(Tokenizer, "encode", slow_encode)
    body = json.dumps({"prompt": "the def", "max_tokens": 1}).encode()
    slow = asyncio.ensure_future(c.coordinator.fetch(Request("POST", "https://co/v1/completions", {}, body)))
    while not order:
        await asyncio.sleep(0.01)
    r = await c.coordinator.fetch(Request("GET", "https://co/v1/models"))
    assert r.status == 200
    answered.set()
    order.append("models answered")
    assert (await slow).status == 200
    assert order == ["encode waits", "models answered", "encode done"], order
    await c.drain()


async def test_off_loop_runs_inline_where_threads_cannot_start(monkeypatch):
    """Pyodide has no threads: off_loop falls back to running the function in place."""
    main = threading.get_ident()
    assert await offload.off_loop(threading.get_ident) != main
    loop = asyncio.get_running_loop()

    def no_threads(*a, **k):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(offload, "_threads", True)
    monkeypatch.setattr(loop, "run_in_executor", no_threads)
    assert await offload.off_loop(threading.get_ident) == main
    assert offload._threads is False, "tried once, then inline without asking again"
    with pytest.raises(ValueError, match="from fn"):  # fn's own errors propagate either way
        await offload.off_loop(lambda: (_ for _ in ()).throw(ValueError("from fn")))


# ------------------------------------------------------------------ large reply bodies


async def test_a_large_reply_body_arrives_whole_with_its_headers_and_length():
    """A body of SLICED_BODY_BYTES or more is written in slices (no copies); the client still gets
    every byte, its Content-Length (not chunked), its content type and the request id."""
    import numpy as np

    from deploy.local.host import SLICED_BODY_BYTES, WRITE_SLICE_BYTES

    big = np.random.default_rng(0).bytes(2 * WRITE_SLICE_BYTES + 7)
    bodies = {"/small": b"s" * 1000, "/edge": bytes(SLICED_BODY_BYTES), "/big": big, "/parts": big[::-1]}
    cuts = [0, 3, WRITE_SLICE_BYTES + 1, WRITE_SLICE_BYTES + 1, len(big)]  # parts across slices, one empty

    async def handler(request: Request, env, ctx) -> Response:
        if request.path == "/parts":  # a warden's batch: frames sent one by one, never joined
            body = bodies["/parts"]
            return Response.from_parts([body[a:b] for a, b in zip(cuts, cuts[1:])], "application/x-knot-tensor-batch",
                                       headers={"X-Knot-Etag": "e1"})
        return Response.from_bytes(bodies[request.path], "application/x-knot-tensor-batch", headers={"X-Knot-Etag": "e1"})

    rt = ServiceRuntime("layer-warden", handler, Env(), BackgroundTasks("test"))
    async with TestClient(TestServer(build_app(rt))) as client:
        for path, body in bodies.items():
            r = await client.get(path, headers={"X-Request-Id": f"rid{path}"})
            assert r.status == 200 and await r.read() == body, path
            assert r.headers["Content-Length"] == str(len(body)) and "Transfer-Encoding" not in r.headers
            assert r.headers["Content-Type"] == "application/x-knot-tensor-batch" and r.headers["X-Knot-Etag"] == "e1"
            assert r.headers["X-Request-Id"] == f"rid{path}"
