"""Signed internal calls (issue 13 item 4): common/signing.py, and the host that signs what its
bindings send and refuses unsigned calls to an internal service."""
from __future__ import annotations

import time

import aiohttp
import pytest
from aiohttp import web

from common import signing
from common.runtime import Env, Request, Response, Unauthorized
from deploy.local.bindings import HttpNamespace, HttpService, Signer
from deploy.local.durable import DO_NAME_HEADER
from deploy.local.host import ServiceRuntime, app_runner, build_app
from deploy.local.tasks import BackgroundTasks

SECRET = "s" * 43
NONCE = "0123456789abcdef"


def test_a_signature_covers_method_path_body_time_and_object():
    h = signing.sign(SECRET, "POST", "/forward", b"frame", 1000.0, NONCE)
    v = signing.Verifier(SECRET)
    v.verify("POST", "/forward", b"frame", h, 1010.0)
    for method, path, body, do_name in [("GET", "/forward", b"frame", ""), ("POST", "/embed", b"frame", ""),
                                        ("POST", "/forward", b"frame!", ""), ("POST", "/forward", b"frame", "x")]:
        with pytest.raises(Unauthorized, match="does not match"):
            signing.Verifier(SECRET).verify(method, path, body, h, 1010.0, do_name)
    with pytest.raises(Unauthorized, match="does not match"):
        signing.Verifier("t" * 43).verify("POST", "/forward", b"frame", h, 1010.0)


def test_replays_stale_and_missing_signatures_are_refused():
    v = signing.Verifier(SECRET, window_s=300)
    h = signing.sign(SECRET, "POST", "/invalidate/x", b"", 1000.0, NONCE)
    v.verify("POST", "/invalidate/x", b"", h, 1000.0)
    with pytest.raises(Unauthorized, match="already used"):
        v.verify("POST", "/invalidate/x", b"", h, 1001.0)
    with pytest.raises(Unauthorized, match="window"):
        v.verify("POST", "/invalidate/x", b"", signing.sign(SECRET, "POST", "/invalidate/x", b"", 1000.0, "f" * 16),
                 1000.0 + 301)
    with pytest.raises(Unauthorized, match="carries no"):
        v.verify("POST", "/invalidate/x", b"", None, 1000.0)
    with pytest.raises(Unauthorized, match="malformed"):
        v.verify("POST", "/invalidate/x", b"", "v1 t=1,n=zz,s=00", 1000.0)
    assert v.stats()["accepted"] == 1 and v.stats()["refused"] == 4
    with pytest.raises(ValueError, match="at least 32"):
        signing.Verifier("short")


class Echo:
    def __init__(self):
        self.calls = 0

    async def fetch(self, request: Request, env, ctx) -> Response:
        self.calls += 1
        return Response.from_json({"path": request.path, "body": len(request.body)})


async def _serve(rt: ServiceRuntime):
    runner = app_runner(build_app(rt))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_an_internal_service_answers_only_signed_calls():
    echo = Echo()
    rt = ServiceRuntime("station", echo.fetch, Env(), BackgroundTasks("test"), verifier=signing.Verifier(SECRET))
    runner, url = await _serve(rt)
    try:
        async with aiohttp.ClientSession() as s:
            # the binding signs: the call goes through (a Durable Object's too, named in the signature)
            r = await HttpService(s, url, 10, Signer(SECRET)).fetch(Request("POST", "/forward?x=1", {}, b"frame"))
            assert r.status == 200 and r.json() == {"path": "/forward", "body": 5}
            ns = HttpNamespace(s, url, "Echo", 10, Signer(SECRET))
            r = await ns.get(ns.id_from_name("w")).fetch(Request("GET", "/stats"))
            assert r.status == 400 and "hosts no Durable Objects" in r.json()["message"], "past the signature check"
            # unsigned, signed with another secret, replayed, or changed: 401 before the handler runs
            before = echo.calls
            r = await HttpService(s, url, 10).fetch(Request("POST", "/forward", {}, b"frame"))
            assert r.status == 401 and "carries no X-Knot-Signature" in r.json()["message"]
            r = await HttpService(s, url, 10, Signer("t" * 43)).fetch(Request("POST", "/invalidate/a", {}, b""))
            assert r.status == 401 and "does not match" in r.json()["message"]
            h = Signer(SECRET).header("POST", "/configure", b"{}")
            async with s.post(url + "/configure", data=b"{}", headers={signing.SIGNATURE_HEADER: h}) as r:
                assert r.status == 200
            async with s.post(url + "/configure", data=b"{}", headers={signing.SIGNATURE_HEADER: h}) as r:
                assert r.status == 401 and "already used" in (await r.json())["message"]
            h = Signer(SECRET).header("POST", "/configure", b"{}")
            async with s.post(url + "/configure", data=b"{\"x\": 1}", headers={signing.SIGNATURE_HEADER: h}) as r:
                assert r.status == 401
            h = Signer(SECRET).header("GET", "/__do/Echo/stats", b"", "w")  # signed for one object,
            async with s.get(url + "/__do/Echo/stats", headers={signing.SIGNATURE_HEADER: h,
                                                                DO_NAME_HEADER: "other"}) as r:
                assert r.status == 401  # sent to another
            assert echo.calls == before + 1, "no refused call reached the handler"
            async with s.get(url + "/healthz") as r:  # the host's probes need no signature
                assert r.status == 200
            assert SECRET not in repr(Signer(SECRET))
    finally:
        await runner.cleanup()


async def test_a_public_service_takes_unsigned_calls():
    echo = Echo()
    rt = ServiceRuntime("coordinator", echo.fetch, Env(), BackgroundTasks("test"), public=True,
                        verifier=signing.Verifier(SECRET))
    runner, url = await _serve(rt)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", data=b"{}") as r:
                assert r.status == 200 and echo.calls == 1
    finally:
        await runner.cleanup()


def test_the_launcher_generates_one_secret_per_cluster_and_compose_passes_it(tmp_path):
    import os
    import stat

    from deploy import cluster_secrets, launcher

    got = cluster_secrets.ensure(tmp_path / "secrets.env")
    secret = got["KNOT_INTERNAL_SECRET"]
    assert len(secret) >= signing.MIN_SECRET_CHARS and stat.S_IMODE(os.stat(tmp_path / "secrets.env").st_mode) == 0o600
    assert cluster_secrets.ensure(tmp_path / "secrets.env") == got, "kept across `up`s (a restart still authenticates)"
    assert cluster_secrets.ensure(tmp_path / "other" / "secrets.env") != got, "another cluster, another secret"
    # every service of our image gets it through compose's environment (never argv)
    specs = launcher.plan(launcher.default_layout(), {"KNOT_INTERNAL_SECRET": secret, "KNOT_REDIS_PASSWORD": "any"})
    ours = [s for s in specs if s.kind == "process"]
    assert ours and all(s.environment["KNOT_INTERNAL_SECRET"] == secret for s in ours)
    assert all(secret not in " ".join(s.command) for s in specs)
    # a tool calling a service directly signs with the cluster's secret
    h = launcher.Cluster(tmp_path).signed("GET", "http://127.0.0.1:1234/stats?x=1")
    signing.Verifier(secret).verify("GET", "/stats?x=1", b"", h[signing.SIGNATURE_HEADER], time.time())
