"""deploy/supervisor.py on real (tiny) processes: a service that dies is started again with its
recipe, after a backoff that grows, and cluster.json records the new pid and the restarts."""
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from deploy import cluster_secrets, servers, supervisor
from deploy.launcher import STATE_FILE, Cluster


def test_a_dead_service_is_restarted_with_backoff_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "POLL_S", 0.05)
    monkeypatch.setattr(supervisor, "BACKOFF_S", 0.2)
    secret = "k" * 43
    cluster_secrets.write(tmp_path / cluster_secrets.FILE_NAME, {"KNOT_INTERNAL_SECRET": secret})
    recipe = {"kind": "process", "argv": [sys.executable, "-c", "import time; time.sleep(60)"],
              "env": {"LC_ALL": "C"}, "secrets": {"KNOT_INTERNAL_SECRET": "KNOT_INTERNAL_SECRET"}, "cwd": str(tmp_path),
              "log": str(tmp_path / "logs" / "svc.log")}
    supervisor.write_recipes(tmp_path, {"svc": recipe})
    assert oct(os.stat(tmp_path / supervisor.RECIPES_FILE).st_mode & 0o777) == "0o600"
    pid = supervisor.start(recipe, {"KNOT_INTERNAL_SECRET": secret})
    (tmp_path / STATE_FILE).write_text(json.dumps({"layout": {}, "supervisor": None, "services": [
        {"name": "svc", "kind": "process", "pid": pid, "port": None, "url": None, "log": recipe["log"]}]}))
    stop = [False]
    t = threading.Thread(target=supervisor.supervise, args=(tmp_path, stop))
    t.start()
    pids = [pid]
    try:
        gaps = []
        for restart in (1, 2):
            os.kill(pids[-1], signal.SIGKILL)
            t0 = time.monotonic()
            while True:
                row = Cluster(tmp_path).status()[0]
                if row["restarts"] == restart and servers.pid_alive(row["pid"]):
                    break
                assert time.monotonic() - t0 < 10, row
                time.sleep(0.02)
            gaps.append(time.monotonic() - t0)
            pids.append(row["pid"])
        assert len(set(pids)) == 3 and row["restarted_at"] > 0
        assert gaps[0] >= 0.2 and gaps[1] >= 0.4, f"the backoff doubles: {gaps}"
        environ = Path(f"/proc/{pids[-1]}/environ").read_bytes()
        assert f"KNOT_INTERNAL_SECRET={secret}".encode() in environ, "restarted with the cluster's secret"
        assert secret not in (tmp_path / STATE_FILE).read_text() + (tmp_path / supervisor.RECIPES_FILE).read_text()
    finally:
        stop[0] = True
        t.join(5)
        for p in pids:
            if servers.pid_alive(p):
                servers.stop_pid(p, 5)
