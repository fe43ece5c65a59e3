"""Signed internal calls on real processes (issue 13 item 4, issue 52 item 5): a warden started as
docker-compose.yml defines it, with the cluster's secret, answers only calls signed with it; a call
signed for one station is refused by its sibling, and one from before a shard's restart by the
restarted shard, while the cluster's own calls go on working across the restart."""
import dataclasses
import json

import pytest

from deploy import servers
from deploy.local.server_bindings import Signer
from common.signing import SIGNATURE_HEADER

from .conftest import http, pipeline_services, signed_headers
from .test_wardens import layer_headers

KNOT_KEY = "signed-pipeline.knot"

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
        # it calls itself what its KNOT_SERVICE_NAME says: layer-warden, as docker-compose.yml names it
        sig = {SIGNATURE_HEADER: Signer(SECRET, "layer-warden").header("GET", "/stats", b"")}
        status, _, body = http("GET", url + "/stats", headers={**headers, **sig})
        assert status == 200, body
        status, _, body = http("GET", url + "/stats", headers={**headers, **sig})
        assert status == 401 and "already used" in json.loads(body)["message"]
        payload = json.dumps({"knot_key": key, "layer_start": 0, "layer_end": 2}).encode()
        forged = {SIGNATURE_HEADER: Signer("y" * 43, "layer-warden").header("POST", "/configure", payload)}
        status, _, body = http("POST", url + "/configure", payload, headers={**headers, **forged})
        assert status == 401 and "does not match" in json.loads(body)["message"]
        log = open(procs.running[name].log).read()
        assert SECRET not in log, "the secret is never logged"
    finally:
        procs.stop(name)
        del procs.specs[name], procs.addresses[name]


@pytest.fixture(scope="module")
def cluster(procs, upload, knot):
    with pipeline_services(procs, knot.path, upload(KNOT_KEY)) as p:
        yield p


def generate(cluster) -> list[int]:
    status, _, raw = http("POST", cluster.url("coordinator") + "/generate",
                          {"prompt": "the def the", "max_tokens": 8, "temperature": 0}, timeout_s=120)
    assert status == 200, raw
    return json.loads(raw)["tokens"]


def test_a_call_signed_for_one_station_is_refused_by_its_sibling(cluster):
    for name, sibling in (("station-0", "station-1"), ("shard-0", "shard-1")):
        captured = signed_headers("GET", cluster.url(name) + "/stats", to=name)
        status, _, body = http("GET", cluster.url(sibling) + "/stats", headers=captured)
        assert status == 401 and f"another service than {sibling}" in json.loads(body)["message"], body
        status, _, body = http("GET", cluster.url(name) + "/stats", headers=captured)
        assert status == 200, body  # it was good for its own destination, once
        status, _, body = http("GET", cluster.url(name) + "/stats", headers=captured)
        assert status == 401 and "already used" in json.loads(body)["message"]


def test_a_call_from_before_a_restart_is_refused_after_it_and_the_cluster_goes_on(cluster):
    before = generate(cluster)
    url = cluster.url("shard-3") + "/stats"
    accepted = signed_headers("GET", url, to="shard-3")
    assert http("GET", url, headers=accepted)[0] == 200
    unsent = signed_headers("GET", url, to="shard-3")  # captured on the way, never delivered
    cluster.restart("shard-3")  # a new process: the nonces it accepted are gone with the old one
    for captured in (accepted, unsent):
        status, _, body = http("GET", url, headers=captured)
        assert status == 401 and "before shard-3 started" in json.loads(body)["message"], body
    assert http("GET", url)[0] == 200, "a call signed now passes"
    assert generate(cluster) == before, "the coordinator's calls to the restarted shard are signed afresh"
