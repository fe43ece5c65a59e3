"""SeaweedFS as the cluster's closed bucket: one S3 identity (the cluster's keys), JWTs on its own ports.

    write_identities(path, access_key, secret_key)   -s3.config's JSON, mode 600
    weed_env(base)                                   the environment with fresh JWT keys (per start)
    list_buckets(url, access_key, secret_key)        the status of a ListBuckets signed with SigV4
    python3 seaweedfs.py serve DIR [weed args...]    the stand-in image's command (deploy/docker/offline.yml)
    python3 seaweedfs.py check URL                   its healthcheck

With an identity configured, SeaweedFS's S3 API answers 403 to an anonymous request and to one
signed with another key (InvalidAccessKeyId, SignatureDoesNotMatch); without one it takes anything.
Its filer and volume servers have HTTP ports of their own, which bypass S3's identities: the
WEED_JWT_* keys make them want a JWT signed with a key that only the `weed server` process holds
(401 otherwise). They are random per start: the tokens live seconds and every component is in
that one process. Its gRPC ports stay unauthenticated (that needs mutual TLS): they listen on
127.0.0.1 (the launcher) or inside the container's network (compose); docs/runtime.md says so.

The keys come from the environment (MINIO_ROOT_USER, MINIO_ROOT_PASSWORD: `knot cluster up` keeps
them in its secrets.env, `knot secrets` writes them to compose's .env) and reach `weed` only
through the 0600 file: never its argv, which `ps` shows to every user.

Standard library only, no project imports: scripts/docker-images.sh copies this file alone into the
SeaweedFS image, and deploy/servers.py uses the same functions for `knot cluster up` and the tests.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import secrets
import sys
import urllib.error
import urllib.request
from urllib.parse import urlsplit

IDENTITIES_FILE = "s3-identities.json"  # in the data directory
IDENTITY_NAME = "knot"
ACTIONS = ("Admin", "Read", "List", "Tagging", "Write")
JWT_KEYS = ("WEED_JWT_SIGNING_KEY", "WEED_JWT_SIGNING_READ_KEY",  # the volume servers' writes and reads
            "WEED_JWT_FILER_SIGNING_KEY", "WEED_JWT_FILER_SIGNING_READ_KEY")  # the filer's
REGION = "us-east-1"
ACCESS_KEY_VAR, SECRET_KEY_VAR = "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"


def write_identities(path: str, access_key: str, secret_key: str) -> None:
    """The -s3.config file: one identity with every action, mode 600 from its first byte."""
    if not access_key or not secret_key:
        raise ValueError("the bucket needs an access key and a secret key (deploy/cluster_secrets.py)")
    config = {"identities": [{"name": IDENTITY_NAME, "actions": list(ACTIONS),
                              "credentials": [{"accessKey": access_key, "secretKey": secret_key}]}]}
    # deploy.cluster_secrets.write_private's steps: this file is copied alone into the stand-in image
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, json.dumps(config).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def weed_env(base: dict[str, str]) -> dict[str, str]:
    """base with fresh random WEED_JWT_* keys (SeaweedFS reads security.toml's keys from WEED_*)."""
    return {**base, **{name: secrets.token_urlsafe(32) for name in JWT_KEYS}}


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def list_buckets(url: str, access_key: str, secret_key: str, timeout_s: float = 2.0) -> int:
    """The HTTP status of GET / (ListBuckets) signed with AWS Signature Version 4; 0 when nothing answers.
    ref: AWS's "Create a signed AWS API request" (the four steps, as below)."""
    host = urlsplit(url).netloc
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(b"").hexdigest()
    signed_headers = "host;x-amz-content-sha256;x-amz-date"
    # 1. the canonical request: method, path, query, headers (sorted, lower case), their names, payload hash
    request = "\n".join(("GET", "/", "", f"host:{host}", f"x-amz-content-sha256:{payload}",
                         f"x-amz-date:{amz_date}", "", signed_headers, payload))
    # 2. the string to sign; 3. the key, derived per day, region and service; 4. the signature
    scope = f"{day}/{REGION}/s3/aws4_request"
    to_sign = "\n".join(("AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(request.encode()).hexdigest()))
    key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret_key}".encode(), day), REGION), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers = {"x-amz-date": amz_date, "x-amz-content-sha256": payload,
               "Authorization": f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                                f"SignedHeaders={signed_headers}, Signature={signature}"}
    return _status(urllib.request.Request(url.rstrip("/") + "/", headers=headers), timeout_s)


def anonymous_status(url: str, timeout_s: float = 2.0) -> int:
    """The HTTP status of an unsigned GET / (403 when the identities are in force); 0 when nothing answers."""
    return _status(urllib.request.Request(url.rstrip("/") + "/"), timeout_s)


def _status(request: urllib.request.Request, timeout_s: float) -> int:
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def keys_from(env: dict[str, str]) -> tuple[str, str]:
    access_key, secret_key = env.get(ACCESS_KEY_VAR, ""), env.get(SECRET_KEY_VAR, "")
    if not access_key or not secret_key:
        raise SystemExit(f"{ACCESS_KEY_VAR} and {SECRET_KEY_VAR} must be set: the bucket's keys, generated per "
                         f"cluster (`knot secrets` writes them to .env)")
    return access_key, secret_key


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "serve":  # serve DIR [weed server args...]
        data_dir, weed_args = argv[1], argv[2:]
        identities = os.path.join(data_dir, IDENTITIES_FILE)
        write_identities(identities, *keys_from(dict(os.environ)))
        env = weed_env({k: v for k, v in os.environ.items() if k not in (ACCESS_KEY_VAR, SECRET_KEY_VAR)})
        os.execvpe("weed", ["weed", "server", "-s3", f"-dir={data_dir}", f"-s3.config={identities}", *weed_args], env)
    if len(argv) == 2 and argv[0] == "check":  # check URL: signed ListBuckets 200, anonymous 403
        return 0 if list_buckets(argv[1], *keys_from(dict(os.environ))) == 200 and \
            anonymous_status(argv[1]) == 403 else 1
    sys.stderr.write("usage: seaweedfs.py serve DIR [weed server args...] | check URL\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
