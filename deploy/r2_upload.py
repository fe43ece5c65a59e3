"""The knot into R2 through its S3-compatible API: a multipart upload, resumable, every part checked.

`wrangler r2 object put` refuses a file over 300 MiB, and the knots are larger (the 0.5B's is
464 MiB, the 1.5B's 1.1 GB), so `knot deploy cloudflare --upload` puts the knot here instead:

    endpoint   https://<account id>.r2.cloudflarestorage.com (R2), or any S3 server (the tests' SeaweedFS)
    keys       an R2 API token's access key id and secret (R2_ACCESS_KEY_ID, R2_SECRET_ACCESS_KEY)
    parts      part_bytes each (R2 wants every part but the last the same size, at least 5 MiB), at
               most 10,000; each sent with its Content-MD5, which the server checks (BadDigest otherwise)
    state      STATE: the upload id and, per part sent, the MD5 of the bytes sent and the ETag the
               server answered, written after every part
    record     RECORD (next to the Workers' configs): bucket, key, size, parts and the object's ETag

Resuming: a run that finds a state for the same bucket, key, file size and part size asks the server
which parts it holds (ListParts) and sends only the others. A part the server holds is kept only when
its size is right and its ETag is the one answered when it was sent (or, with no record of it, the
MD5 of the local bytes, as S3 servers name a part) while the local bytes still have the MD5 that was
sent: a part of a file changed since is sent again. An upload the server no longer knows (aborted, or
expired) starts over.

After CompleteMultipartUpload, HeadObject must give the file's size; its ETag is recorded, with the
S3 form of the parts sent ("<MD5 of the parts' MD5s>-<parts>"; a server that gives an ETag of that
form but another value gets a warning: R2 does not promise S3's ETag arithmetic). boto3 1.36 and later add CRC32 checksums to every request by default, which some S3-compatible
servers refuse; the client sends the checksums asked for here only (Content-MD5).
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_PART_BYTES = 64 * MiB  # 8 parts for the 0.5B's knot, 18 for the 1.5B's; 64 MiB in memory at a time
MIN_PART_BYTES = 5 * MiB  # S3's and R2's least part (but the last)
MAX_PARTS = 10_000
WRANGLER_PUT_MAX_BYTES = 300 * MiB  # what `wrangler r2 object put` takes (wrangler 4)
STATE = "upload-state-{name}.json"  # in the state directory, per object
RECORD = "knot-upload.json"


class UploadError(RuntimeError):
    pass


def r2_endpoint(account_id: str) -> str:
    """R2's S3 endpoint for a Cloudflare account."""
    if not account_id or not account_id.isalnum():
        raise UploadError(f"account id {account_id!r}: expected the 32 hex digits of the Cloudflare dashboard")
    return f"https://{account_id}.r2.cloudflarestorage.com"


@dataclass(frozen=True)
class Target:
    """Where the object goes: the S3 endpoint, its keys and the bucket."""

    endpoint_url: str
    access_key_id: str
    secret_access_key: str = field(repr=False)  # never shown
    bucket: str = "knots"
    region: str = "auto"  # R2's; SeaweedFS and MinIO take any
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 300.0  # one part's PUT, at a slow uplink's pace


def client(t: Target):
    config = Config(connect_timeout=t.connect_timeout_s, read_timeout=t.read_timeout_s,
                    retries={"max_attempts": 3, "mode": "standard"}, s3={"addressing_style": "path"},
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    return boto3.client("s3", endpoint_url=t.endpoint_url, aws_access_key_id=t.access_key_id,
                        aws_secret_access_key=t.secret_access_key, region_name=t.region, config=config)


@dataclass
class Uploaded:
    """What the upload left in the bucket (RECORD), and what this run sent."""

    bucket: str
    key: str
    size: int
    part_bytes: int
    parts: int
    etag: str  # the object's, as HeadObject gives it
    parts_md5: str = ""  # "<MD5 of the parts' MD5s>-<parts>": S3's multipart ETag of the bytes sent
    sent_parts: list[int] = field(default_factory=list)  # part numbers this run sent
    kept_parts: list[int] = field(default_factory=list)  # already on the server from an earlier run

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("sent_parts", "kept_parts")}


def part_ranges(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """[(start, end)) of each part; every one part_bytes long but the last."""
    if part_bytes < MIN_PART_BYTES:
        raise UploadError(f"part size {part_bytes} bytes: S3 and R2 take parts of at least {MIN_PART_BYTES}")
    if size <= 0:
        raise UploadError("the file is empty")
    n = -(-size // part_bytes)
    if n > MAX_PARTS:
        raise UploadError(f"{size} bytes in parts of {part_bytes} is {n} parts, more than {MAX_PARTS}: "
                          f"raise the part size")
    return [(a, min(a + part_bytes, size)) for a in range(0, size, part_bytes)]


def _read(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if len(data) != end - start:
        raise UploadError(f"{path}: read {len(data)} bytes at {start}, expected {end - start} (the file changed?)")
    return data


def _quoted(etag: str) -> str:
    return etag if etag.startswith('"') else f'"{etag}"'


def _state_path(state_dir: Path, bucket: str, key: str) -> Path:
    name = hashlib.sha256(f"{bucket}/{key}".encode()).hexdigest()[:16]
    return state_dir / STATE.format(name=name)


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def _server_parts(s3, bucket: str, key: str, upload_id: str) -> dict[int, dict] | None:
    """The parts the server holds of an upload (number -> its ListParts entry); None: it has no such upload."""
    parts: dict[int, dict] = {}
    marker = 0
    while True:
        try:
            page = s3.list_parts(Bucket=bucket, Key=key, UploadId=upload_id, PartNumberMarker=marker)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchUpload", "404", "NotFound"):
                return None
            raise
        for p in page.get("Parts", []):
            parts[int(p["PartNumber"])] = p
        if not page.get("IsTruncated"):
            return parts
        marker = int(page["NextPartNumberMarker"])


def upload(path: str | os.PathLike, target: Target, key: str, state_dir: str | os.PathLike,
           part_bytes: int = DEFAULT_PART_BYTES, on_part: Callable[[int, int], None] | None = None) -> Uploaded:
    """Upload the file at path to target.bucket/key, resuming an earlier run's upload (its state is in
    state_dir); returns what is in the bucket. on_part(number, of) is called after each part sent."""
    path, state_dir = Path(path), Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    size = path.stat().st_size
    ranges = part_ranges(size, part_bytes)
    s3 = client(target)
    state_file = _state_path(state_dir, target.bucket, key)
    want = {"endpoint_url": target.endpoint_url, "bucket": target.bucket, "key": key, "size": size,
            "part_bytes": part_bytes}
    state = json.loads(state_file.read_text()) if state_file.is_file() else None
    held: dict[int, dict] | None = None
    if state is not None and all(state.get(k) == v for k, v in want.items()):
        held = _server_parts(s3, target.bucket, key, state["upload_id"])
        if held is None:
            log.info("upload %s of %s/%s is gone from the server: starting over", state["upload_id"], target.bucket, key)
    if held is None:
        upload_id = s3.create_multipart_upload(Bucket=target.bucket, Key=key,
                                               ContentType="application/octet-stream")["UploadId"]
        state, held = {**want, "upload_id": upload_id, "parts": {}}, {}
        _write_json(state_file, state)
    upload_id = state["upload_id"]
    done = Uploaded(target.bucket, key, size, part_bytes, len(ranges), "")
    etags: list[str] = []
    md5s: list[bytes] = []
    for number, (a, b) in enumerate(ranges, 1):
        data = _read(path, a, b)
        md5 = hashlib.md5(data).digest()
        md5s.append(md5)
        sent = state["parts"].get(str(number))
        on_server = held.get(number)
        if on_server is not None and int(on_server["Size"]) == b - a:
            server_etag = _quoted(str(on_server["ETag"]))
            recorded = sent is not None and sent["md5"] == md5.hex() and _quoted(sent["etag"]) == server_etag
            if recorded or (sent is None and server_etag == _quoted(md5.hex())):
                etags.append(server_etag)
                done.kept_parts.append(number)
                continue
        reply = s3.upload_part(Bucket=target.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data,
                               ContentLength=b - a, ContentMD5=base64.b64encode(md5).decode("ascii"))
        etag = _quoted(str(reply["ETag"]))  # the server checked the bytes against Content-MD5 (BadDigest if not)
        etags.append(etag)
        state["parts"][str(number)] = {"md5": md5.hex(), "etag": etag}
        _write_json(state_file, state)
        done.sent_parts.append(number)
        if on_part is not None:
            on_part(number, len(ranges))
    s3.complete_multipart_upload(Bucket=target.bucket, Key=key, UploadId=upload_id, MultipartUpload={
        "Parts": [{"PartNumber": i, "ETag": e} for i, e in enumerate(etags, 1)]})
    head = s3.head_object(Bucket=target.bucket, Key=key)
    if int(head["ContentLength"]) != size:
        raise UploadError(f"{target.bucket}/{key}: {head['ContentLength']} bytes in the bucket, the file has {size}")
    done.etag = str(head["ETag"]).strip('"')
    done.parts_md5 = f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(ranges)}"
    if done.etag.endswith(f"-{len(ranges)}") and done.etag != done.parts_md5:
        # S3's multipart ETag is this; R2 documents its ETags as opaque, so a difference is reported, not fatal
        log.warning("%s/%s: ETag %s is not the MD5 of the parts sent (%s)", target.bucket, key, done.etag,
                    done.parts_md5)
    state_file.unlink()
    return done


def write_record(out_dir: str | os.PathLike, done: Uploaded) -> Path:
    """RECORD next to the Workers' configs: what the bucket holds (the ETag every read is pinned to)."""
    path = Path(out_dir) / RECORD
    _write_json(path, done.record())
    return path
