"""Signed internal calls (issue 13 item 4): common/signing.py, and the host that signs what its
bindings send and refuses unsigned calls to an internal service."""
from __future__ import annotations

import time

import aiohttp
import pytest
from aiohttp import web

from common import signing
from common.runtime import Env, Request, Response, Unauthorized
from deploy.local.server_bindings import HttpNamespace, HttpService, Signer
from deploy.local.durable import DO_NAME_HEADER
from deploy.local.host import ServiceRuntime, app_runner, build_app
from deploy.local.tasks import BackgroundTasks

SECRET = "s" * 43
NONCE = "0123456789abcdef"


def verifier(service: str = "station-0", booted_at: float = 900.0, **kw) -> signing.Verifier:
    return signing.Verifier(SECRET, service, booted_at=booted_at, **kw)


def test_a_signature_covers_method_path_destination_body_time_and_object():
    h = signing.sign(SECRET, "POST", "/forward", b"frame", 1000.0, NONCE, to="station-0")
    assert h.startswith("v2 t=1000000,"), "milliseconds"
    verifier().verify("POST", "/forward", b"frame", h, 1010.0)
    for method, path, body, do_name in [("GET", "/forward", b"frame", ""), ("POST", "/embed", b"frame", ""),
                                        ("POST", "/forward", b"frame!", ""), ("POST", "/forward", b"frame", "x")]:
        with pytest.raises(Unauthorized, match="does not match"):
            verifier().verify(method, path, body, h, 1010.0, do_name)
    with pytest.raises(Unauthorized, match="does not match"):
        signing.Verifier("t" * 43, "station-0", booted_at=900.0).verify("POST", "/forward", b"frame", h, 1010.0)
    # signed for station-0: its sibling (same secret, same code) refuses it
    with pytest.raises(Unauthorized, match="another service than station-1"):
        verifier("station-1").verify("POST", "/forward", b"frame", h, 1010.0)
    for name in ("", None):
        with pytest.raises((ValueError, TypeError)):
            signing.Verifier(SECRET, name, booted_at=0.0)
        with pytest.raises((ValueError, TypeError)):
            Signer(SECRET, name)


def test_replays_stale_old_and_missing_signatures_are_refused():
    v = verifier(window_s=300)
    h = signing.sign(SECRET, "POST", "/invalidate/x", b"", 1000.0, NONCE, to="station-0")
    v.verify("POST", "/invalidate/x", b"", h, 1000.0)
    with pytest.raises(Unauthorized, match="already used"):
        v.verify("POST", "/invalidate/x", b"", h, 1001.0)
    with pytest.raises(Unauthorized, match="window"):
        v.verify("POST", "/invalidate/x", b"",
                 signing.sign(SECRET, "POST", "/invalidate/x", b"", 1000.0, "f" * 16, to="station-0"), 1000.0 + 301)
    with pytest.raises(Unauthorized, match="carries no"):
        v.verify("POST", "/invalidate/x", b"", None, 1000.0)
    with pytest.raises(Unauthorized, match="malformed"):
        v.verify("POST", "/invalidate/x", b"", "v2 t=1,n=zz,s=00", 1000.0)
    # a v1 signature (no destination, whole seconds) is refused, and the message says why
    v1 = "v1 t=1000,n=0123456789abcdef,s=" + "0" * 64
    with pytest.raises(Unauthorized, match="version 'v1' is not accepted: this service takes v2"):
        v.verify("POST", "/invalidate/x", b"", v1, 1000.0)
    assert v.stats()["accepted"] == 1 and v.stats()["refused"] == 5
    with pytest.raises(ValueError, match="at least 32"):
        signing.Verifier("short", "station-0", booted_at=0.0)


def test_a_restarted_verifier_refuses_calls_signed_before_it_booted():
    """The nonces die with a process: its next incarnation refuses anything signed before it booted."""
    first = verifier(booted_at=1000.0)
    h = signing.sign(SECRET, "POST", "/forward", b"frame", 1500.0, NONCE, to="station-0")
    first.verify("POST", "/forward", b"frame", h, 1500.0)
    again = verifier(booted_at=1501.0)  # restarted a second later: the same call, replayed
    with pytest.raises(Unauthorized, match="signed 1.000 s before station-0 started"):
        again.verify("POST", "/forward", b"frame", h, 1501.5)
    # a call signed since, even within the same second as the boot, passes: t is in milliseconds
    again.verify("POST", "/forward", b"frame",
                 signing.sign(SECRET, "POST", "/forward", b"frame", 1501.001, "e" * 16, to="station-0"), 1501.5)
    # a send's own delay before the boot (a kept-alive connection found stale, sent again) is tolerated
    again.verify("POST", "/forward", b"frame", signing.sign(SECRET, "POST", "/forward", b"frame",
                                                            1501.0 - signing.BOOT_SKEW_S / 2, "d" * 16,
                                                            to="station-0"), 1501.5)
    with pytest.raises(Unauthorized, match="before station-0 started"):
        again.verify("POST", "/forward", b"frame", signing.sign(SECRET, "POST", "/forward", b"frame",
                                                                1501.0 - 2 * signing.BOOT_SKEW_S, "c" * 16,
                                                                to="station-0"), 1501.5)


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
    rt = ServiceRuntime("station", echo.fetch, Env(), BackgroundTasks("test"),
                        verifier=signing.Verifier(SECRET, "station", booted_at=time.time()))
    runner, url = await _serve(rt)
    try:
        async with aiohttp.ClientSession() as s:
            # the binding signs: the call goes through (a Durable Object's too, named in the signature)
            r = await HttpService(s, url, 10, Signer(SECRET, "station")).fetch(Request("POST", "/forward?x=1", {},
                                                                                       b"frame"))
            assert r.status == 200 and r.json() == {"path": "/forward", "body": 5}
            ns = HttpNamespace(s, url, "Echo", 10, Signer(SECRET, "station"))
            r = await ns.get(ns.id_from_name("w")).fetch(Request("GET", "/stats"))
            assert r.status == 400 and "hosts no Durable Objects" in r.json()["message"], "past the signature check"
            # unsigned, signed with another secret, replayed, or changed: 401 before the handler runs
            before = echo.calls
            r = await HttpService(s, url, 10).fetch(Request("POST", "/forward", {}, b"frame"))
            assert r.status == 401 and "carries no X-Knot-Signature" in r.json()["message"]
            r = await HttpService(s, url, 10, Signer("t" * 43, "station")).fetch(Request("POST", "/invalidate/a", {},
                                                                                       b""))
            assert r.status == 401 and "does not match" in r.json()["message"]
            r = await HttpService(s, url, 10, Signer(SECRET, "station-1")).fetch(Request("POST", "/forward", {}, b""))
            assert r.status == 401 and "another service than station" in r.json()["message"], "signed for a sibling"
            h = Signer(SECRET, "station").header("POST", "/configure", b"{}")
            async with s.post(url + "/configure", data=b"{}", headers={signing.SIGNATURE_HEADER: h}) as r:
                assert r.status == 200
            async with s.post(url + "/configure", data=b"{}", headers={signing.SIGNATURE_HEADER: h}) as r:
                assert r.status == 401 and "already used" in (await r.json())["message"]
            h = Signer(SECRET, "station").header("POST", "/configure", b"{}")
            async with s.post(url + "/configure", data=b"{\"x\": 1}", headers={signing.SIGNATURE_HEADER: h}) as r:
                assert r.status == 401
            h = Signer(SECRET, "station").header("GET", "/__do/Echo/stats", b"", "w")  # signed for one object,
            async with s.get(url + "/__do/Echo/stats", headers={signing.SIGNATURE_HEADER: h,
                                                                DO_NAME_HEADER: "other"}) as r:
                assert r.status == 401  # sent to another
            assert echo.calls == before + 1, "no refused call reached the handler"
            async with s.get(url + "/healthz") as r:  # the host's probes need no signature
                assert r.status == 200
            assert SECRET not in repr(Signer(SECRET, "station"))
    finally:
        await runner.cleanup()


async def test_a_public_service_takes_unsigned_calls():
    echo = Echo()
    rt = ServiceRuntime("coordinator", echo.fetch, Env(), BackgroundTasks("test"), public=True,
                        verifier=signing.Verifier(SECRET, "coordinator", booted_at=time.time()))
    runner, url = await _serve(rt)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", data=b"{}") as r:
                assert r.status == 200 and echo.calls == 1
    finally:
        await runner.cleanup()


def test_the_launcher_generates_one_secret_per_cluster_and_compose_passes_it(tmp_path):
    import json
    import os
    import stat
    from dataclasses import asdict

    from deploy import cluster_secrets, launcher

    got = cluster_secrets.ensure(tmp_path / "secrets.env")
    secret = got["KNOT_INTERNAL_SECRET"]
    assert len(secret) >= signing.MIN_SECRET_CHARS and stat.S_IMODE(os.stat(tmp_path / "secrets.env").st_mode) == 0o600
    assert cluster_secrets.ensure(tmp_path / "secrets.env") == got, "kept across `up`s (a restart still authenticates)"
    assert cluster_secrets.ensure(tmp_path / "other" / "secrets.env") != got, "another cluster, another secret"
    # every service of our image gets it through compose's environment (never argv)
    specs = launcher.plan(launcher.default_layout(), got)
    ours = [s for s in specs if s.kind == "process"]
    assert ours and all(s.environment["KNOT_INTERNAL_SECRET"] == secret for s in ours)
    assert all(secret not in " ".join(s.command) for s in specs)
    # a tool calling a service directly signs with the cluster's secret, for the service at that port
    running = [launcher.Running("station-1", "process", 1, 1234, "http://127.0.0.1:1234", "log")]
    (tmp_path / launcher.STATE_FILE).write_text(json.dumps({"services": [asdict(r) for r in running]}))
    h = launcher.Cluster(tmp_path).signed("GET", "http://127.0.0.1:1234/stats?x=1")
    signing.Verifier(secret, "station-1", booted_at=time.time() - 1).verify("GET", "/stats?x=1", b"",
                                                                         h[signing.SIGNATURE_HEADER], time.time())
    with pytest.raises(launcher.LauncherError, match="no service of the cluster"):
        launcher.Cluster(tmp_path).signed("GET", "http://127.0.0.1:4321/stats")


def test_each_binding_signs_for_its_peer_by_name():
    """docker-compose.yml's binding URLs name the peer by host; the launcher, which rewrites them to
    127.0.0.1:PORT, keeps the name as #NAME, and the host signs for it."""
    from deploy import launcher
    from deploy.local.host_settings import parse_binding

    assert parse_binding("STATION_0", "http://station-0:8080").peer == "station-0"
    b = parse_binding("STATION_0", "http://127.0.0.1:4100#station-0")
    assert (b.target, b.peer) == ("http://127.0.0.1:4100", "station-0")
    b = parse_binding("LAYER_WARDEN", "do+http://127.0.0.1:4101/LayerWarden#layer-warden")
    assert (b.base_url, b.target, b.peer) == ("http://127.0.0.1:4101", "LayerWarden", "layer-warden")
    secrets = {"KNOT_REDIS_PASSWORD": "p", "KNOT_INTERNAL_SECRET": SECRET, "MINIO_ROOT_USER": "u",
               "MINIO_ROOT_PASSWORD": "pw"}
    specs = {s.name: s for s in launcher.plan(launcher.default_layout(), secrets)}
    addresses = {name: (8080, 4000 + i) for i, name in enumerate(specs)}
    addresses["minio"], addresses["redis"] = (9000, 3900), (6379, 3901)
    env = launcher.process_env(specs["coordinator"], addresses, 4999, {})
    assert env["STATION_1"] == f"http://127.0.0.1:{addresses['station-1'][1]}#station-1"
    assert env["SHARD_7"] == f"http://127.0.0.1:{addresses['shard-7'][1]}#shard-7"
    assert env["S3_ENDPOINT_URL"] == "http://127.0.0.1:3900", "not a binding: no name added"
    env = launcher.process_env(specs["station-0"], addresses, 4998, {})
    assert env["LAYER_WARDEN"] == f"do+http://127.0.0.1:{addresses['layer-warden'][1]}/LayerWarden#layer-warden"
    assert env["KNOT_SERVICE_NAME"] == "station-0", "what its verifier checks the destination against"
