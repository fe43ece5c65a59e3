"""Signed internal calls on a real process (issue 13 item 4): a warden started as docker-compose.yml
defines it, with the cluster's secret, answers only calls signed with it."""
import dataclasses
import json

from deploy import servers
from deploy.local.bindings import Signer
from common.signing import SIGNATURE_HEADER

from .conftest import http
from .test_wardens import layer_headers

SECRET = "x" * 43


def test_a_warden_with_the_secret_refuses_unsigned_and_replayed_calls(procs, upload):
    key = upload("tests/signed.knot")
    spec = procs.specs["layer-warden"]
    name = "layer-warden-signed"
    procs.specs[name] = dataclasses.replace(spec, name=name,
                                            environment={**spec.environment, "KNOT_INTERNAL_SECRET": SECRET})
    procs.addresses[name] = (8080, servers.free_ports(1)[0])
    procs.start(name)  # ready: /readyz needs no signature
    try:
        url = procs.url(name)
        headers = layer_headers(key, 0, 2)
        status, _, body = http("GET", url + "/stats", headers=headers, signed=False)
        assert status == 401 and "carries no X-Knot-Signature" in json.loads(body)["message"]
        sig = {SIGNATURE_HEADER: Signer(SECRET).header("GET", "/stats", b"")}
        status, _, body = http("GET", url + "/stats", headers={**headers, **sig})
        assert status == 200, body
        status, _, body = http("GET", url + "/stats", headers={**headers, **sig})
        assert status == 401 and "already used" in json.loads(body)["message"]
        payload = json.dumps({"knot_key": key, "layer_start": 0, "layer_end": 2}).encode()
        forged = {SIGNATURE_HEADER: Signer("y" * 43).header("POST", "/configure", payload)}
        status, _, body = http("POST", url + "/configure", payload, headers={**headers, **forged})
        assert status == 401 and "does not match" in json.loads(body)["message"]
        log = open(procs.running[name].log).read()
        assert SECRET not in log, "the secret is never logged"
    finally:
        procs.stop(name)
        del procs.specs[name], procs.addresses[name]
