"""Issues 12 and 52 on real processes (the coordinator, 2 stations, 8 shards and both wardens as
docker-compose.yml defines them, on SeaweedFS and Redis): a knot replaced in the bucket with rows of
the LM head or of the embedding overwritten (the header untouched) is refused on every request and
counted, never a token; another, self-consistent knot under the key is refused by the pin (the
digest the services loaded); once the original is back the tokens are the baseline's again (no
stale Redis rows); a Redis value of the right length but the wrong content is detected,
counted, refetched, and the tokens stay the baseline's; so is a row forged with the Redis password
and a right crc32 but without the cluster's secret, before and after the services restart."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
import redis

from common.integrity import CacheKey
from common.knot import parse_header
from deploy.encoder import encode
from common.quant import dequantize_rows
from common.sampling import SamplingParams
from deploy.engine_local import LocalEngine
from deploy.local.server_bindings import s3_client
from services.embed_cache import decode_row, encode_row, row_key
from tests.integration.conftest import BUCKET, SPEC, http, pipeline_services, wait_for
from tests.tiny_gguf import write_tiny_gguf

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


def generate(cluster, prompt: str = PROMPT) -> tuple[int, dict]:
    status, _, raw = http("POST", cluster.url("coordinator") + "/generate", {"prompt": prompt, "max_tokens": N},
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


@pytest.mark.parametrize("tensor", ["output.weight", "token_embd.weight"])
def test_a_knot_with_rows_overwritten_is_refused_on_every_request_and_the_original_comes_back_clean(
        cluster, knot, s3, tmp_path, redis_server, cluster_env, tensor):
    baseline = tokens(cluster)
    assert baseline == reference(knot.path)
    etag = s3.head_object(Bucket=BUCKET, Key=KNOT_KEY)["ETag"].strip('"')
    # The probe: the same knot, same size, the header untouched, one row overwritten with the
    # next one's bytes: the LM head's row of the first generated token (every shard reads its head
    # slice by range), or the embedding row of the prompt's last token (rows are read by range).
    ids = LocalEngine.open(knot.path).tokenizer.encode(PROMPT)
    row = ids[-1] if tensor == "token_embd.weight" else baseline[0]
    h = parse_header(knot.data)
    data = bytearray(knot.data)
    a, b = h.row_range(tensor, row, row + 1)
    c, d = h.row_range(tensor, row + 1, row + 2)
    data[a:b] = data[c:d]
    changed = tmp_path / "changed.knot"
    changed.write_bytes(bytes(data))
    assert reference(changed) != baseline, "the changed row must change the tokens for this test to mean anything"
    assert parse_header(bytes(data)).digest == h.digest  # the pin cannot see it: the chunk digests must

    corrupt = metric(cluster, "knot_r2_corrupt_reads_total")
    reloads = metric(cluster, "knot_version_reloads_total")
    s3.put_object(Bucket=BUCKET, Key=KNOT_KEY, Body=bytes(data))
    for _ in range(3):  # never a token from it, however often asked
        status, body = generate(cluster)
        assert status == 503 and body["error"] == "IntegrityFailure", body
        assert "KnotCorrupt" in body["message"] and f"tensor {tensor}: chunk " in body["message"], body
    assert metric(cluster, "knot_r2_corrupt_reads_total") >= corrupt + 3  # counted: each refusal read it
    assert metric(cluster, "knot_version_reloads_total") == reloads + 1  # the coordinator's

    s3.put_object(Bucket=BUCKET, Key=KNOT_KEY, Body=knot.data)  # the original back (the same etag as before)
    assert s3.head_object(Bucket=BUCKET, Key=KNOT_KEY)["ETag"].strip('"') == etag
    assert tokens(cluster) == baseline
    assert metric(cluster, "knot_version_reloads_total") == reloads + 2
    # Redis holds, under the original's version, only the original's rows (issue 12: a changed row was
    # cached there for 24 h and served after the restore).
    e = h.tensors["token_embd.weight"]
    rows = kv_rows(redis_server, etag)
    assert ids[-1] in rows
    for row, value in rows.items():
        a, b = h.row_range("token_embd.weight", row, row + 1)
        np.testing.assert_array_equal(decode_row(cluster_key(cluster_env), row_key(f"{KNOT_KEY}@{etag}", row), value,
                                                 etag, row, e.shape[0]),
                                      dequantize_rows(knot.data[a:b], e.ggml_type, e.shape[0])[0])


def test_another_knot_under_the_key_is_refused_by_the_pin(cluster, knot, s3, tmp_path_factory):
    """A self-consistent knot of another model uploaded under the key (KNOT_DIGEST unset: every service
    pinned the digest it loaded first). What the services hold is served on; what needs the bucket is
    a 503 naming both digests; never the other model's tokens. The original back serves everything."""
    baseline = tokens(cluster)
    d = tmp_path_factory.mktemp("other")
    other = d / "other.knot"
    encode(write_tiny_gguf(d / "other.gguf", replace(SPEC, seed=1)), other, progress=False)
    ours, theirs = parse_header(knot.data).digest, parse_header(other.read_bytes()).digest
    _, _, raw = http("GET", cluster.url("coordinator") + "/v1/models")
    assert json.loads(raw)["data"][0]["knot_digest"] == ours

    s3.put_object(Bucket=BUCKET, Key=KNOT_KEY, Body=other.read_bytes())
    assert tokens(cluster) == baseline  # the loaded version: every row this prompt needs is held
    _, _, raw = http("GET", cluster.url("coordinator") + "/v1/models")
    assert json.loads(raw)["data"][0]["knot_digest"] == ours
    fresh = "tu re in de"  # rows no tier holds: a read of the bucket, which holds the refused knot
    for _ in range(3):
        status, body = generate(cluster, fresh)
        assert status == 503 and body["error"] == "IntegrityFailure", body
    assert f"digest {theirs}, refused: this service is pinned to {ours}" in body["message"], body
    assert "knot cluster reload" in body["message"]

    s3.put_object(Bucket=BUCKET, Key=KNOT_KEY, Body=knot.data)
    assert tokens(cluster) == baseline
    status, body = generate(cluster, fresh)
    assert status == 200, body


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
