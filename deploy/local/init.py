"""The compose `init` service: fetch the model, encode it to a .knot, upload it to the bucket once.

    KNOT_MODEL   a registered model name (deploy.models) or a local .gguf/.knot path
    KNOT_KEY     the object key in the bucket
    KNOT_BUCKET  s3://BUCKET (S3_ENDPOINT_URL, AWS_* as for the services) or dir:PATH
    KNOT_DIGEST  optional: the knot's digest the cluster is pinned to (the local knot must have it)
(common/settings.py declares them; docs/configuration.md lists them.)

Idempotent: an object already at KNOT_KEY whose header parses and whose size passes the
stale-knot guard is left alone, so only the first start uploads (a knot of an older format
version is refused by the reader, so it is replaced once); with KNOT_DIGEST, an object with
another digest is replaced too.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Mapping

import botocore.exceptions
from boto3.s3.transfer import TransferConfig

from common.knot import KnotError, read_header_sync
from common.settings import ConfigError, read
from deploy.local.server_bindings import S3Settings, s3_client
from deploy.local.host_settings import parse_binding

log = logging.getLogger("deploy.local.init")
MULTIPART_CHUNK_BYTES = 64 << 20
# Parts in flight at once. boto3's default, 10, sends 640 MiB at once; a store that admits less
# (the SeaweedFS stand-in of deploy/docker caps in-flight uploads at 128 MB to stay in its memory
# limit) leaves the others unread until S3_READ_TIMEOUT_S resets them, and init fails on a slow
# disk. Two parts keep every admitted socket moving.
UPLOAD_CONCURRENCY = 2


def s3_settings(env: Mapping[str, str]) -> S3Settings:
    return S3Settings(*(read(env, n, "init") for n in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                       "AWS_REGION", "S3_CONNECT_TIMEOUT_S", "S3_READ_TIMEOUT_S")))


def knot_for(model: str, pin: str = "") -> Path:
    """The local knot to upload; with pin, it must have that digest (ConfigError otherwise)."""
    from deploy.models import ensure_knot  # fetch (pip) + encode, both cached

    path = ensure_knot(model)
    digest = read_header_sync(_file_reader(path)).digest
    if pin and digest != pin:
        raise ConfigError(f"{path} has digest {digest}, KNOT_DIGEST pins {pin}: set KNOT_DIGEST to the model's "
                          f"digest (`knot inspect {path}`) or KNOT_MODEL to the pinned model", name="KNOT_DIGEST")
    return path


def _valid_remote(read_range, size: int, pin: str = "") -> bool:
    try:
        header = read_header_sync(read_range, file_size=size)
    except KnotError as e:  # an older format version too
        log.warning("the bucket's knot is unusable (%s): uploading again", e)
        return False
    if pin and header.digest != pin:
        log.warning("the bucket's knot has digest %s, KNOT_DIGEST pins %s: uploading again", header.digest, pin)
        return False
    return True


def _file_reader(path: Path):
    def read_range(a: int, b: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(a)
            return f.read(b - a)

    return read_range


def upload_s3(env: Mapping[str, str], bucket: str, key: str, model: str, pin: str = "") -> str:
    s3 = s3_client(s3_settings(env))
    try:
        s3.head_bucket(Bucket=bucket)
    except botocore.exceptions.ClientError:
        log.info("creating bucket %s", bucket)
        s3.create_bucket(Bucket=bucket)
    try:
        size = int(s3.head_object(Bucket=bucket, Key=key)["ContentLength"])
    except botocore.exceptions.ClientError:
        size = None
    if size is not None:
        def read_range(a: int, b: int) -> bytes:
            r = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={a}-{min(b, size) - 1}")  # inclusive end
            return r["Body"].read()

        if _valid_remote(read_range, size, pin):
            return f"s3://{bucket}/{key} already present ({size} bytes), not uploading"
    path = knot_for(model, pin)
    s3.upload_file(str(path), bucket, key, Config=TransferConfig(multipart_chunksize=MULTIPART_CHUNK_BYTES,
                                                                     max_concurrency=UPLOAD_CONCURRENCY))
    got = int(s3.head_object(Bucket=bucket, Key=key)["ContentLength"])
    if got != path.stat().st_size:
        raise ConfigError(f"upload of {path} to s3://{bucket}/{key}: {got} bytes landed, expected {path.stat().st_size}")
    return f"uploaded {path} ({got} bytes) to s3://{bucket}/{key}"


def upload_dir(root: Path, key: str, model: str, pin: str = "") -> str:
    dest = root / key
    if dest.is_file() and _valid_remote(_file_reader(dest), dest.stat().st_size, pin):
        return f"{dest} already present, not copying"
    path = knot_for(model, pin)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.copyfile(path, tmp)
    os.replace(tmp, dest)
    return f"copied {path} to {dest}"


def run(env: Mapping[str, str]) -> str:
    model, key, url = (read(env, n, "init") for n in ("KNOT_MODEL", "KNOT_KEY", "KNOT_BUCKET"))
    pin = read(env, "KNOT_DIGEST", "init") or ""
    bucket = parse_binding("KNOT_BUCKET", url)
    if bucket.scheme == "s3":
        return upload_s3(env, bucket.target, key, model, pin)
    if bucket.scheme == "dir":
        return upload_dir(Path(bucket.target), key, model, pin)
    raise ConfigError(f"KNOT_BUCKET={url}: init knows s3:// and dir: buckets")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s init: %(message)s")
    try:
        log.info(run(os.environ))
    except (ConfigError, KnotError, OSError, ValueError, botocore.exceptions.BotoCoreError,
            botocore.exceptions.ClientError) as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
