"""A closed bucket (issue 52 item 4) on the real SeaweedFS: started as the launcher starts it, its S3
API answers 403 to anonymous and wrong-key calls, and its filer and volume ports, which bypass S3,
401; the cluster's keys work. The offline image's command (deploy/seaweedfs.py serve), run here,
closes it the same way."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from deploy import cluster_secrets, seaweedfs, servers

from .conftest import CREDENTIALS

KEY = "closed/x.bin"
BODY = bytes(range(256)) * 64


def status(method: str, url: str, data: bytes | None = None, headers: dict | None = None) -> int:
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def client(url: str, access_key: str, secret_key: str):
    return boto3.client("s3", endpoint_url=url, aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                        region_name="us-east-1", config=Config(retries={"max_attempts": 1},
                                                               s3={"addressing_style": "path"}))


def refused(call) -> str:
    with pytest.raises(ClientError) as e:
        call()
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403, e.value.response
    return e.value.response["Error"]["Code"]


def weed_ports(pid: int) -> dict[str, int]:
    """The ports `weed server` was given (-filer.port=N ...), from its command line."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return {a[1:].split("=")[0]: int(a.split("=")[1]) for a in args if a.startswith("-") and a.split("=")[-1].isdigit()}


def check_closed(url: str, access_key: str, secret_key: str, bucket: str) -> None:
    good = client(url, access_key, secret_key)
    if bucket not in [b["Name"] for b in good.list_buckets()["Buckets"]]:
        good.create_bucket(Bucket=bucket)
    good.put_object(Bucket=bucket, Key=KEY, Body=BODY)
    got = good.get_object(Bucket=bucket, Key=KEY, Range="bytes=100-163")
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 206 and got["Body"].read() == BODY[100:164]
    # anonymous: a PUT of the object and of a bucket, a GET, a ranged GET, ListBuckets
    assert status("PUT", f"{url}/{bucket}/{KEY}", b"evil") == 403
    assert status("PUT", f"{url}/evil-bucket") == 403
    assert status("GET", f"{url}/{bucket}/{KEY}") == 403
    assert status("GET", f"{url}/{bucket}/{KEY}", headers={"Range": "bytes=0-9"}) == 403
    assert status("GET", f"{url}/") == 403
    # signed, but with the wrong secret, or a key the server does not know
    assert refused(lambda: client(url, access_key, "w" * 40).put_object(Bucket=bucket, Key=KEY,
                                                                         Body=b"evil")) == "SignatureDoesNotMatch"
    assert refused(lambda: client(url, "NOBODY" * 3, secret_key).put_object(Bucket=bucket, Key=KEY,
                                                                             Body=b"evil")) == "InvalidAccessKeyId"
    assert refused(lambda: client(url, access_key, "w" * 40).get_object(Bucket=bucket, Key=KEY,
                                                                         Range="bytes=0-9")) == "SignatureDoesNotMatch"
    assert good.get_object(Bucket=bucket, Key=KEY)["Body"].read() == BODY, "nothing refused changed the object"


def test_the_launchers_seaweedfs_refuses_anonymous_and_wrong_keys(s3_server, upload):
    """The tests' server is started as `knot cluster up` starts it (deploy/servers.py), with CREDENTIALS."""
    check_closed(s3_server.url, CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"], "knots")
    ports = weed_ports(s3_server.pid)
    filer, volume = f"http://127.0.0.1:{ports['filer.port']}", f"http://127.0.0.1:{ports['volume.port']}"
    # the filer's and volume server's own HTTP ports, which S3's identities do not cover, want a JWT
    assert status("PUT", f"{filer}/buckets/knots/{KEY}", b"evil") == 401
    assert status("GET", f"{filer}/buckets/knots/{KEY}") == 401
    assert status("POST", f"{volume}/1,01637037d6", b"evil") == 401
    cmdline = Path(f"/proc/{s3_server.pid}/cmdline").read_bytes()
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"].encode() not in cmdline, "keys never in argv (`ps` shows it)"


def test_the_offline_images_command_closes_the_bucket_with_the_clusters_keys(tmp_path):
    """deploy/seaweedfs.py serve, as the stand-in image runs it (its own ports here), with the keys
    `knot secrets` generates; its healthcheck passes only with them."""
    keys = cluster_secrets.ensure(tmp_path / ".env")
    ports = dict(zip(servers.WEED_PORTS, servers.free_ports(len(servers.WEED_PORTS))))
    data = tmp_path / "data"
    data.mkdir()
    env = {**os.environ, "PATH": os.pathsep.join((str(Path(servers.weed_binary()).parent), os.defpath)),
           "MINIO_ROOT_USER": keys["MINIO_ROOT_USER"], "MINIO_ROOT_PASSWORD": keys["MINIO_ROOT_PASSWORD"]}
    args = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false", "-s3.port.iceberg=0",
            "-s3.port.lance=0", "-volume.max=4", "-master.volumeSizeLimitMB=64", "-volume.preStopSeconds=0",
            *(f"-{flag}={ports[name]}" for name, flag in (
                ("master", "master.port"), ("master_grpc", "master.port.grpc"), ("volume", "volume.port"),
                ("volume_grpc", "volume.port.grpc"), ("filer", "filer.port"), ("filer_grpc", "filer.port.grpc"),
                ("s3", "s3.port"), ("s3_grpc", "s3.port.grpc")))]
    log = open(tmp_path / "weed.log", "wb")
    proc = subprocess.Popen([sys.executable, "-I", str(Path(seaweedfs.__file__)), "serve", str(data), *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{ports['s3']}"
    check = [sys.executable, "-I", str(Path(seaweedfs.__file__)), "check", url]
    try:
        servers._wait(lambda: subprocess.run(check, env=env, timeout=10).returncode == 0, "the stand-in SeaweedFS",
                      proc.pid, tmp_path / "weed.log", 60)
        identities = data / seaweedfs.IDENTITIES_FILE
        assert oct(identities.stat().st_mode & 0o777) == "0o600"
        assert json.loads(identities.read_text())["identities"][0]["credentials"] == [
            {"accessKey": keys["MINIO_ROOT_USER"], "secretKey": keys["MINIO_ROOT_PASSWORD"]}]
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert b"MINIO_ROOT_PASSWORD" not in environ and b"WEED_JWT_FILER_SIGNING_KEY=" in environ
        assert keys["MINIO_ROOT_PASSWORD"].encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        check_closed(url, keys["MINIO_ROOT_USER"], keys["MINIO_ROOT_PASSWORD"], "knots")
        wrong = {**env, "MINIO_ROOT_PASSWORD": "w" * 40}
        assert subprocess.run(check, env=wrong, timeout=10).returncode == 1, "the healthcheck needs the keys"
    finally:
        servers.stop_pid(proc.pid, 2.0)
        log.close()
