"""`knot deploy cloudflare --upload` against the real S3 server the tests start (SeaweedFS), with a file
over wrangler's 300 MiB: a multipart upload interrupted after its first parts, then resumed by the
command itself, sending only the parts that are not there (and one whose local bytes changed); the
object read back equals the file, and its ETag is recorded next to the configs.

The file is sparse (a few random blocks in 300 MiB of holes) and the parts are 80 MiB, so the test
writes ~300 MiB to SeaweedFS in 4 parts (5 of the default 64 MiB)."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy import r2_upload
from deploy.local.server_bindings import s3_client
from tests.integration.conftest import BUCKET, CREDENTIALS

MiB = 1 << 20
SIZE = 300 * MiB + 12_345  # over `wrangler r2 object put`'s 300 MiB; parts of 80 MiB, the last 60 MiB
PART_MIB = 80


class Interrupted(Exception):
    pass


def sparse_file(path: Path) -> Path:
    """SIZE bytes, mostly holes, with a random MiB at the start of each part and at the end."""
    rng = os.urandom
    with open(path, "wb") as f:
        f.truncate(SIZE)
        for offset in (*range(0, SIZE, PART_MIB * MiB), SIZE - MiB):
            f.seek(offset)
            f.write(rng(MiB))
    return path


def sha256(read, size: int) -> str:
    h = hashlib.sha256()
    for a in range(0, size, 16 * MiB):
        h.update(read(a, min(a + 16 * MiB, size)))
    return h.hexdigest()


def file_range(path: Path):
    def read(a: int, b: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(a)
            return f.read(b - a)
    return read


@pytest.fixture
def bucket(s3_settings):
    client = s3_client(s3_settings)
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.ClientError as e:  # made by an earlier test of the session
        if e.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise
    return client


def test_an_interrupted_upload_over_300_mib_resumes_and_reads_back_equal(s3_server, bucket, tiny_knot, tmp_path):
    big = sparse_file(tmp_path / "big.knot")
    assert big.stat().st_size > r2_upload.WRANGLER_PUT_MAX_BYTES
    out, key = tmp_path / "cf", "r2-upload-test.knot"
    target = r2_upload.Target(s3_server.url, CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                              BUCKET)

    def stop_after_two(number: int, of: int) -> None:
        if number == 2:
            raise Interrupted(f"part {number} of {of}")

    with pytest.raises(Interrupted):
        r2_upload.upload(big, target, key, out, PART_MIB * MiB, stop_after_two)
    state = json.loads(next(out.glob("upload-state-*.json")).read_text())
    assert sorted(state["parts"]) == ["1", "2"]
    with pytest.raises(bucket.exceptions.ClientError):  # nothing is an object yet
        bucket.head_object(Bucket=BUCKET, Key=key)
    # part 2 changes locally after it was sent: the resumed upload must send it again
    with open(big, "r+b") as f:
        f.seek(PART_MIB * MiB + 5)
        f.write(b"changed")

    # resumed by the documented command (the model gives the Workers' shape, --upload FILE the bytes)
    env = {**os.environ, "R2_ENDPOINT_URL": s3_server.url, "R2_ACCESS_KEY_ID": CREDENTIALS["AWS_ACCESS_KEY_ID"],
           "R2_SECRET_ACCESS_KEY": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "deploy", "cloudflare", "--out", str(out),
                           "--model", str(tiny_knot), "--knot-key", key, "--bucket", BUCKET,
                           f"--upload={big}", "--part-size-mib", str(PART_MIB)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 sent, 1 already there" in proc.stdout, proc.stdout  # parts 2 (changed), 3 and 4
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in proc.stdout + proc.stderr
    assert not list(out.glob("upload-state-*.json"))  # done: the state is gone

    record = json.loads((out / r2_upload.RECORD).read_text())
    head = bucket.head_object(Bucket=BUCKET, Key=key)
    assert record["etag"] == head["ETag"].strip('"') and record["etag"] in proc.stdout
    assert (record["bucket"], record["key"], record["size"], record["parts"]) == (BUCKET, key, SIZE, 4)
    assert record["etag"] == record["parts_md5"]  # SeaweedFS names a multipart object as S3 does

    def remote(a: int, b: int) -> bytes:
        return bucket.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={a}-{b - 1}")["Body"].read()

    assert sha256(remote, SIZE) == sha256(file_range(big), SIZE)


def test_a_part_that_does_not_match_its_md5_is_refused(s3_server, bucket, tmp_path):
    """The server checks each part's Content-MD5: the guard the upload relies on."""
    upload = bucket.create_multipart_upload(Bucket=BUCKET, Key="r2-md5-test")
    wrong = base64.b64encode(hashlib.md5(b"other bytes").digest()).decode()
    with pytest.raises(bucket.exceptions.ClientError, match="BadDigest"):
        bucket.upload_part(Bucket=BUCKET, Key="r2-md5-test", UploadId=upload["UploadId"], PartNumber=1,
                           Body=os.urandom(5 * MiB), ContentMD5=wrong)
    bucket.abort_multipart_upload(Bucket=BUCKET, Key="r2-md5-test", UploadId=upload["UploadId"])


def test_part_ranges_and_their_limits():
    assert r2_upload.part_ranges(12 * MiB + 1, 5 * MiB) == [(0, 5 * MiB), (5 * MiB, 10 * MiB),
                                                             (10 * MiB, 12 * MiB + 1)]
    with pytest.raises(r2_upload.UploadError, match="at least"):
        r2_upload.part_ranges(100 * MiB, 4 * MiB)
    with pytest.raises(r2_upload.UploadError, match="more than 10000"):
        r2_upload.part_ranges(10_001 * 5 * MiB, 5 * MiB)
    with pytest.raises(r2_upload.UploadError, match="account id"):
        r2_upload.r2_endpoint("not an id/")
    assert r2_upload.r2_endpoint("0123abcd") == "https://0123abcd.r2.cloudflarestorage.com"
