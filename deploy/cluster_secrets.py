"""Per-cluster secrets: generated once, kept in a file only its owner can read, never logged.

    SECRETS         the table, one row per secret: its variable and what it protects (add new ones here)
    ensure(path)    the file's secrets; any that are missing are generated and the file (re)written, 0600

The file is dotenv text (NAME=value lines), so one format serves both deployments:
- `knot cluster up` keeps it in its run directory (.knot-run/secrets.env) and reuses it on every
  restart, so a restarted service still authenticates against the Redis the cluster runs, and to
  (and is trusted by) the cluster's other services;
- `knot secrets` writes .env next to docker-compose.yml, which docker compose reads by itself (the
  compose file refuses to start without any of them: ${NAME:?...}).
A value goes only into 0600 files and into the environment of our own processes (/proc/PID/environ
is readable by the same user only): never into a process's arguments (`ps` shows those to every
user), a log line, cluster.json or an exception message.
"""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

SECRETS: dict[str, str] = {
    "KNOT_REDIS_PASSWORD": "the cluster's Redis (the Workers KV stand-in): its requirepass, every client's AUTH",
    "KNOT_INTERNAL_SECRET": "every internal call's HMAC signature (common/signing.py): services refuse unsigned calls",
    "MINIO_ROOT_USER": "the bucket's S3 access key: MinIO's root user, SeaweedFS's one identity (deploy/seaweedfs.py), "
                       "every service's AWS_ACCESS_KEY_ID",
    "MINIO_ROOT_PASSWORD": "the bucket's S3 secret key, with MINIO_ROOT_USER: anonymous and other keys get 403",
}
FILE_NAME = "secrets.env"  # in a run directory (`knot cluster up`, `python -m deploy.servers start`)
NBYTES = 32  # token_urlsafe(32): 43 characters of [A-Za-z0-9_-], safe in a URL, a shell and a config file
# The S3 keys as MinIO's own generator makes them (20 and 40 characters; letters and digits only:
# an access key is part of SigV4's Credential=KEY/date/... field).
ALNUM_LENGTHS = {"MINIO_ROOT_USER": 20, "MINIO_ROOT_PASSWORD": 40}
ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
FILE_MODE = 0o600


class SecretsError(RuntimeError):
    pass


def generate(name: str = "") -> str:
    """A fresh value for the secret called name (its ALNUM_LENGTHS form, else token_urlsafe)."""
    if name in ALNUM_LENGTHS:
        return "".join(secrets.choice(ALNUM) for _ in range(ALNUM_LENGTHS[name]))
    return secrets.token_urlsafe(NBYTES)


def read(path: str | Path) -> dict[str, str]:
    """Every NAME=value of the file (blank lines and # comments skipped); SecretsError when others may read it."""
    path = Path(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise SecretsError(f"{path}: mode {mode:o}, readable by other users; `chmod 600 {path}` (or delete it "
                           f"to generate new secrets)")
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep or not name.strip():
            raise SecretsError(f"{path} line {n}: not NAME=value")  # the line itself may hold a secret
        out[name.strip()] = value.strip()
    return out


def write_private(path: str | Path, data: bytes) -> None:
    """Atomically, mode 0600 from the first byte (the file is never readable by others, not even briefly)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # a leftover tmp file keeps its old mode through O_CREAT
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write(path: str | Path, values: dict[str, str]) -> None:
    """The secrets as KEY=value lines, through write_private."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "# Generated per cluster by deploy/cluster_secrets.py: keep it private (mode 600).\n"
    text += "".join(f"{k}={v}\n" for k, v in values.items())
    write_private(path, text.encode())


def ensure(path: str | Path) -> dict[str, str]:
    """The cluster's secrets (the SECRETS names -> values) from the file at path, generating the ones it
    lacks; other entries of the file are kept."""
    path = Path(path)
    values = read(path) if path.exists() else {}
    missing = [name for name in SECRETS if not values.get(name)]
    if missing:
        values.update({name: generate(name) for name in missing})
        write(path, values)
    return {name: values[name] for name in SECRETS}
