"""The real bindings against real servers: S3Bucket on SeaweedFS, RedisKV on Valkey/Redis."""
import asyncio
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import redis

from common.runtime import PreconditionFailed, RangeNotSatisfiable, ServiceUnavailable
from deploy.local.server_bindings import RedisKV, S3Bucket
from tests.waits import until

OBJECT = os.urandom(300_001)


@pytest.fixture(scope="module")
def bucket(s3_settings, upload):
    upload("tests/bindings-marker.knot")  # makes sure the bucket exists
    b = S3Bucket(s3_settings, "knots")
    asyncio.run(b.put("tests/object.bin", OBJECT))
    return b


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, len(OBJECT) - 1), n=st.one_of(st.integers(1, 16), st.integers(1, len(OBJECT))))
def test_range_read_equals_slice(bucket, start, n):
    end = min(start + n, len(OBJECT))
    obj = asyncio.run(bucket.get("tests/object.bin", range=(start, end)))
    assert obj.body == OBJECT[start:end]
    assert (obj.size, obj.range) == (len(OBJECT), (start, end))


async def test_bucket_contract(bucket):
    whole = await bucket.get("tests/object.bin")
    assert whole.body == OBJECT and whole.size == len(OBJECT) and whole.etag
    assert (await bucket.get("tests/object.bin", range=(len(OBJECT) - 1, len(OBJECT)))).body == OBJECT[-1:]
    meta = await bucket.head("tests/object.bin")
    assert (meta.size, meta.etag) == (len(OBJECT), whole.etag)
    assert await bucket.get("tests/absent") is None and await bucket.head("tests/absent") is None
    assert "tests/object.bin" in [m.key for m in await bucket.list("tests/")]
    with pytest.raises(RangeNotSatisfiable, match="runs past the object's 300001 bytes"):
        await bucket.get("tests/object.bin", range=(10, len(OBJECT) + 5))
    with pytest.raises(RangeNotSatisfiable):
        await bucket.get("tests/object.bin", range=(len(OBJECT) + 1, len(OBJECT) + 9))
    await bucket.ping()


async def test_if_match_reads_only_that_version(bucket):
    """S3 If-Match (R2 onlyIf): a same-size replacement is refused, never read as the old version."""
    v1 = await bucket.put("tests/versioned.bin", b"a" * 1000)
    got = await bucket.get("tests/versioned.bin", range=(10, 20), if_match=v1.etag)
    assert (got.body, got.etag) == (b"a" * 10, v1.etag)
    v2 = await bucket.put("tests/versioned.bin", b"b" * 1000)
    assert v2.etag != v1.etag
    with pytest.raises(PreconditionFailed, match="no longer version"):
        await bucket.get("tests/versioned.bin", range=(10, 20), if_match=v1.etag)
    assert (await bucket.get("tests/versioned.bin", range=(10, 20), if_match=v2.etag)).body == b"b" * 10
    assert (await bucket.get("tests/versioned.bin", if_match=v2.etag)).body == b"b" * 1000


async def test_kv_put_get_delete_and_ttl_expiry(redis_server):
    kv = RedisKV(redis_server.url, "test-kv:", timeout_s=2.0, password=redis_server.password)
    try:
        await kv.put("plain", b"\x00\x01")
        await kv.put("short", b"x", expiration_ttl=1)
        assert await kv.get("plain") == b"\x00\x01" and await kv.get("short") == b"x"
        async def expired() -> bool:
            return await kv.get("short") is None
        await until(expired, timeout_s=10, poll_s=0.1, what="the server expiring the 1 s TTL")
        assert await kv.get("plain") == b"\x00\x01"
        await kv.delete("plain")
        assert await kv.get("plain") is None
        other = RedisKV(redis_server.url, "other-ns:", timeout_s=2.0, password=redis_server.password)
        await kv.put("k", b"1")
        assert await other.get("k") is None  # namespaces do not see each other
        await other.close()
    finally:
        await kv.close()


async def test_redis_refuses_a_client_without_the_cluster_password(redis_server, run_dir):
    """The test Redis is started as every cluster's is: it requires the generated password."""
    for password in (None, "not-the-password"):
        r = redis.Redis.from_url(redis_server.url, password=password, socket_timeout=2.0)
        with pytest.raises(redis.exceptions.AuthenticationError):
            r.set("EMBED_CACHE:intruder", b"poison")
        r.close()
    with redis_server.client() as r:
        assert r.ping() and r.get("EMBED_CACHE:intruder") is None  # nothing was written
    # Our binding without it: a failing KV (ServiceUnavailable: the caches count it a miss), never a read.
    anonymous = RedisKV(redis_server.url, "test-kv:", timeout_s=2.0)
    try:
        with pytest.raises(ServiceUnavailable, match="KV get"):
            await anonymous.get("plain")
    finally:
        await anonymous.close()
    # The password lives in a 0600 file, never in the server's command line (`ps` shows it to anyone;
    # the server rewrites its process title once up, so this reads the title, argv before that).
    cmdline = open(f"/proc/{redis_server.pid}/cmdline", "rb").read()
    assert b"-server" in cmdline and redis_server.password.encode() not in cmdline
    for path in (run_dir / "redis" / "redis.conf", run_dir / "secrets.env"):
        assert os.stat(path).st_mode & 0o077 == 0, path
    log = (run_dir / "logs" / "redis.log").read_text()
    assert redis_server.password not in log
