"""Issues 12 and 52 on real processes (the coordinator, 2 stations, 8 shards and both wardens as
docker-compose.yml defines them, on SeaweedFS and Redis): a knot replaced in the bucket is served
from one version or refused, and once the original is back the tokens are the baseline's again
(no stale Redis rows); a Redis value of the right length but the wrong content is detected,
counted, refetched, and the tokens stay the baseline's; so is a row forged with the Redis password
and a right crc32 but without the cluster's secret, before and after the services restart."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import redis

from common.integrity import CacheKey
from common.knot import parse_header
from common.quant import dequantize_rows
from common.sampling import SamplingParams
from deploy.engine_local import LocalEngine
from deploy.local.bindings import s3_client
from services.embed_cache import decode_row, encode_row, row_key
from tests.integration.conftest import BUCKET, http, pipeline_services, wait_for

KNOT_KEY = "integrity.knot"
PROMPT = "the def the"
N = 12
KV_PREFIX = "EMBED_CACHE:"  # the compose file's EMBED_CACHE binding


@pytest.fixture(scope="module")
def s3(s3_settings, upload):
    upload("tests/integrity-marker.knot")  # makes sure the bucket exists
    return s3_client(s3_settings)


@pytest.fixture(scope="module")
def cluster(procs, s3, knot):
    # One PUT, so the etag is the MD5 of the bytes: uploading the original again gives it back, as
    # in the probe, where the old version's KV keys then named the restored object.
    s3.put_object(Bucket=BUCKET, Key=KNOT_KEY, Body=knot.data)
    # No shard-local row LRU, no warm-up, no rows kept by the coordinator: every embedding row goes
    # through the CobordismWarden's tiers.
    no_lru = {f"shard-{i}": {"ROW_CACHE_BYTES": "0", "WARM_WARDEN": "off"} for i in range(8)}
    no_lru["coordinator"] = {"EMBED_ROW_CACHE_BYTES": "0"}
    with pipeline_services(procs, knot.path, KNOT_KEY, no_lru) as p:
        yield p


def reference(path) -> list[int]:
    e = LocalEngine.open(path)
    return e.generate(e.tokenizer.encode(PROMPT), SamplingParams(), max_tokens=N).token_ids


def generate(cluster) -> tuple[int, dict]:
    status, _, raw = http("POST", cluster.url("coordinator") + "/generate", {"prompt": PROMPT, "max_tokens": N},
                          timeout_s=120)
    return status, json.loads(raw)


def tokens(cluster) -> list[int]:
    status, body = generate(cluster)
    assert status == 200, body
    return body["tokens"]


def metric(cluster, name: str, **labels) -> float:
    """The sum of a counter over the series that carry these labels."""
    _, _, raw = http("GET", cluster.url("coordinator") + "/metrics")
    total = 0.0
    for line in raw.decode().splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def kv_rows(redis_server, etag: str) -> dict[int, bytes]:
    """Every embedding row the KV holds for this knot version: row -> value."""
    r = redis_server.client()
    try:
        prefix = KV_PREFIX + row_key(f"{KNOT_KEY}@{etag}", 0)[:-1]
        return {int(k.decode()[len(prefix):]): r.get(k) for k in r.scan_iter(match=prefix + "*")}
    finally:
        r.close()


def test_a_replaced_knot_is_served_from_one_version_and_the_original_comes_back_clean(cluster, knot, s3, tmp_path,
                                                                                      redis_server, cluster_env):
    baseline = tokens(cluster)
    assert baseline == reference(knot.path)
    etag = s3.head_object(Bucket=BUCKET, Key=KNOT_KEY)["ETag"].strip('"')
    # The probe: the same knot, same size, one embedding row overwritten (the prompt's last
    # token's, which decides the first generated token), uploaded over the original.
    ids = LocalEngine.open(knot.path).tokenizer.encode(PROMPT)
    h = parse_header(knot.data)
    data = bytearray(knot.data)
    a, b = h.row_range("token_embd.weight", ids[-1], ids[-1] + 1)
    c, d = h.row_range("token_embd.weight", ids[-1] + 1, ids[-1] + 2)
    data[a:b] = data[c:d]
    changed = tmp_path / "changed.knot"
    changed.write_bytes(bytes(data))
    want_changed = reference(changed)
    assert want_changed != baseline, "the changed row must change the tokens for this test to mean anything"

    s3.put_object(Bucket=BUCKET, Key=KNOT_KEY, Body=bytes(data))
    status, body = generate(cluster)
    if status == 200:  # served from the new version, by every service
        assert body["tokens"] == want_changed, "not the new version's tokens: a stale or mixed version was served"
    else:  # or refused, saying why
        assert status == 503 and "knot" in body["message"], body
    assert metric(cluster, "knot_version_reloads_total") == 1

    s3.put_object(Bucket=BUCKET, Key=KNOT_KEY, Body=knot.data)  # the original back (the same etag as before)
    assert s3.head_object(Bucket=BUCKET, Key=KNOT_KEY)["ETag"].strip('"') == etag
    assert tokens(cluster) == baseline
    assert metric(cluster, "knot_version_reloads_total") == 2
    # Redis holds, under the original's version, only the original's rows (the bug: the changed row
    # was cached there for 24 h and served after the restore).
    e = h.tensors["token_embd.weight"]
    rows = kv_rows(redis_server, etag)
    assert ids[-1] in rows
    for row, value in rows.items():
        a, b = h.row_range("token_embd.weight", row, row + 1)
        np.testing.assert_array_equal(decode_row(cluster_key(cluster_env), row_key(f"{KNOT_KEY}@{etag}", row), value,
                                                 etag, row, e.shape[0]),
                                      dequantize_rows(knot.data[a:b], e.ggml_type, e.shape[0])[0])


def test_a_poisoned_redis_value_is_detected_counted_and_refetched(cluster, knot, s3, procs, redis_server, cluster_env):
    baseline = tokens(cluster)
    etag = s3.head_object(Bucket=BUCKET, Key=KNOT_KEY)["ETag"].strip('"')
    ids = sorted(set(LocalEngine.open(knot.path).tokenizer.encode(PROMPT)))
    rows = wait_for(lambda: (got := kv_rows(redis_server, etag)) and set(ids) <= set(got) and got, 10,
                    "the prompt's rows in KV")
    r = redis_server.client()
    try:
        for t in ids:  # the right length, the wrong content: the top byte (sign, exponent) of the row's
            value = bytearray(rows[t])  # last 64 floats flipped
            value[-253::4] = bytes(x ^ 0x40 for x in value[-253::4])
            r.set(KV_PREFIX + row_key(f"{KNOT_KEY}@{etag}", t), bytes(value), ex=3600)
    finally:
        r.close()
    before = metric(cluster, "knot_cache_rejects_total", tier="kv")
    procs.restart("cobordism-warden")  # its RAM is gone: the rows must come from KV (or R2)

    assert tokens(cluster) == baseline
    assert metric(cluster, "knot_cache_rejects_total", tier="kv") - before == len(ids)
    rejected = 0
    for i in range(8):
        spec = procs.specs[f"shard-{i}"].environment
        vocab = {"X-Knot-Id": KNOT_KEY, "X-Vocab-Start": spec["VOCAB_START"], "X-Vocab-End": spec["VOCAB_END"]}
        _, _, raw = http("GET", procs.url("cobordism-warden") + "/stats", headers=vocab)
        s = json.loads(raw)
        rejected += s["rejects"].get("kv", 0)
        assert s["kv_poisoned"] == s["rejects"].get("kv", 0) and s["knot_etag"] == etag
    assert rejected == len(ids)

    key = cluster_key(cluster_env)
    wait_for(lambda: rewritten(redis_server, key, etag, ids, knot), 10, "the poisoned rows rewritten")


def cluster_key(cluster_env) -> CacheKey:
    """What the cluster keys its KV rows with (KNOT_INTERNAL_SECRET)."""
    return CacheKey(cluster_env["KNOT_INTERNAL_SECRET"])


def rewritten(redis_server, key: CacheKey, etag: str, ids: list[int], knot) -> bool:
    """Each row of ids is in KV again, written by the cluster, and holds the knot's row."""
    h = parse_header(knot.data)
    e = h.tensors["token_embd.weight"]
    got = kv_rows(redis_server, etag)
    for t in ids:
        row = None if t not in got else decode_row(key, row_key(f"{KNOT_KEY}@{etag}", t), got[t], etag, t, e.shape[0])
        if row is None or isinstance(row, str):
            return False
        a, b = h.row_range("token_embd.weight", t, t + 1)
        np.testing.assert_array_equal(row, dequantize_rows(knot.data[a:b], e.ggml_type, e.shape[0])[0])
    return True


def test_a_row_forged_in_redis_without_the_secret_is_never_served_even_after_restarts(cluster, knot, s3, procs,
                                                                                      redis_server, cluster_env):
    """Issue 52: rows written straight into Valkey with the Redis password, in the right layout, for
    the right version and row, with a right crc32 over a far-off vector, and a MAC under a secret
    that is not the cluster's. The answer is the clean one, each row is counted as rejected, deleted
    and rewritten; and when Redis holds forged rows again while the coordinator, the shards and the
    CobordismWarden restart (the issue's kill -9), the same."""
    baseline = tokens(cluster)
    assert baseline == reference(knot.path)
    etag = s3.head_object(Bucket=BUCKET, Key=KNOT_KEY)["ETag"].strip('"')
    ids = sorted(set(LocalEngine.open(knot.path).tokenizer.encode(PROMPT)))
    hidden = parse_header(knot.data).tensors["token_embd.weight"].shape[0]
    key, forger = cluster_key(cluster_env), CacheKey("a-forgers-secret-which-is-not-the-clusters")
    wait_for(lambda: set(ids) <= set(kv_rows(redis_server, etag)), 10, "the prompt's rows in KV")

    def forge() -> None:
        rows = kv_rows(redis_server, etag)
        r = redis_server.client()
        try:
            for t in ids:
                k = row_key(f"{KNOT_KEY}@{etag}", t)
                genuine = decode_row(key, k, rows[t], etag, t, hidden)
                assert not isinstance(genuine, str), genuine
                value = encode_row(forger, k, etag, t, -8 * genuine)
                assert "MAC" in decode_row(key, k, value, etag, t, hidden)  # only the MAC is wrong
                r.set(KV_PREFIX + k, value, ex=3600)
        finally:
            r.close()

    forge()
    before = metric(cluster, "knot_cache_rejects_total", tier="kv")
    procs.restart("cobordism-warden")  # its RAM is gone: the rows must come from KV (or R2)
    assert tokens(cluster) == baseline
    assert metric(cluster, "knot_cache_rejects_total", tier="kv") - before == len(ids)
    wait_for(lambda: rewritten(redis_server, key, etag, ids, knot), 10, "the forged rows rewritten")

    forge()  # Redis holds forged rows again, and every process that reads them restarts
    for name in ("cobordism-warden", *(f"shard-{i}" for i in range(8)), "coordinator"):
        procs.restart(name)
    assert tokens(cluster) == baseline
    assert metric(cluster, "knot_cache_rejects_total", tier="kv") == len(ids)  # counted since the restart
    wait_for(lambda: rewritten(redis_server, key, etag, ids, knot), 10, "the forged rows rewritten")
