"""Issue 52's soak, short (benchmarks/soak.py's run, on the tiny synthetic model): a `knot cluster up`
cluster of real processes under mixed load (short and long prompts, streams, hang-ups, bad bodies)
meets each of the issue's faults once: SIGSTOP of a station past PEER_WAIT_S, SIGSTOP of SeaweedFS,
KV rows forged without the secret, the knot replaced with LM-head rows overwritten, an anonymous PUT,
a signed call replayed to the sibling station. No request gets a 200 with other tokens than the
baseline's, a 500, or no answer within REQUEST_TIMEOUT_S + soak.HANG_MARGIN_S; each fault's own check
holds, and the cluster gives the baseline again after each."""
from __future__ import annotations

import os

from benchmarks import soak
from deploy import launcher, servers

MINUTES = 1.0
PEER_WAIT_S = 2.0
REQUEST_TIMEOUT_S = 30.0
LONG_TOKENS = (200,)  # the tiny model's context is 256


def test_each_fault_under_load_gives_no_wrong_token_no_500_no_hang(tmp_path, knot, record_property):
    env = {**os.environ, "KNOT_PORT": str(servers.free_ports(1)[0]), "PEER_WAIT_S": str(PEER_WAIT_S),
           "REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S), **soak.ROW_PATH_ENV}
    env.pop("KNOT_KEY", None)
    env.pop("KNOT_DIGEST", None)
    cluster = launcher.Cluster(tmp_path / "cluster")
    cluster.up(model=str(knot.path), env=env)
    try:
        result = soak.run(cluster, knot.path, knot.path.stem + ".knot", MINUTES, workers=2, faults=soak.NEW_FAULTS,
                          long_tokens=LONG_TOKENS, peer_wait_s=PEER_WAIT_S, request_timeout_s=REQUEST_TIMEOUT_S,
                          s3_stop_s=5.0, hold_s=3.0)
    finally:
        cluster.down()
    faults = {e["name"]: e for e in result["faults"]}
    record_property("soak_faults", {n: e["requests"] for n, e in faults.items()})
    print("outcomes:", result["by_outcome"])
    for name, e in faults.items():
        print(name, {k: v for k, v in e.items() if k != "t"})

    assert result["failures"] == [] and result["hung_workers"] == 0, result["failures"]
    assert list(faults) == list(soak.NEW_FAULTS)
    assert all(e["recovered_s"] is not None for e in faults.values()), faults
    assert result["longest_request_s"] < result["hang_s"]
    assert result["by_outcome"].get("200", 0) > 20 and result["by_outcome"].get("4xx", 0) > 0, result["by_outcome"]
    assert result["long_prompt_tokens"][0] >= 150, result["long_prompt_tokens"]
    # each fault was what it says: the station stopped past PEER_WAIT_S gave 503s; forged rows were
    # read from Redis and rejected; the replaced knot was refused as IntegrityFailure; the PUT and the
    # replay were refused
    assert faults["stop-station"]["requests"].get("503", 0) > 0, faults["stop-station"]
    assert faults["forge-kv"]["forged_rows"] > 0 and faults["forge-kv"]["kv_rejects_after"] > 0, faults["forge-kv"]
    assert faults["replace-knot"]["refused_after_s"] is not None, faults["replace-knot"]
    assert faults["anonymous-put"]["status"] == 403 and faults["anonymous-put"]["object_unchanged"]
    assert (faults["replay"]["sibling_status"], faults["replay"]["own_status"]) == (401, 200), faults["replay"]
