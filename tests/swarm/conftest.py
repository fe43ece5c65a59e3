"""The stack `knot compose --swarm` writes, deployed by scripts/test-swarm.sh on a Swarm of three
nodes (containers running their own dockerd). That script exports KNOT_SWARM_*; without it
(KNOT_SWARM_STACK unset) these tests skip: they never build or take down a Swarm themselves."""
from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from dataclasses import dataclass

import pytest

from common import settings
from deploy import cluster_secrets


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/swarm/" in str(item.fspath):
            item.add_marker(pytest.mark.swarm)
    if settings.read(os.environ, "KNOT_SWARM_STACK", "tests") == "1":
        return
    skip = pytest.mark.skip(reason="no Swarm: scripts/test-swarm.sh builds one and runs these")
    for item in items:
        if "swarm" in item.keywords:
            item.add_marker(skip)


@dataclass
class Swarm:
    url: str  # the coordinator, on the manager node
    manager: str  # DOCKER_HOST of the manager's engine
    secrets: dict[str, str]  # what `knot secrets --swarm` made Swarm secrets
    nodes: tuple[str, ...]  # the node containers, manager first

    def docker(self, *args: str, on_host: bool = False) -> str:
        """docker ARGS on the Swarm's manager (on_host: the host's engine, which runs the nodes)."""
        env = dict(os.environ) if on_host else {**os.environ, "DOCKER_HOST": self.manager}
        out = subprocess.run(["docker", *args], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def request(self, path: str, body: dict | None = None, timeout_s: float = 300):
        """The coordinator's reply (a file-like response), with the cluster's API key."""
        headers = {"Authorization": f"Bearer {self.secrets['KNOT_API_KEY']}", "Content-Type": "application/json"}
        req = urllib.request.Request(self.url + path, None if body is None else json.dumps(body).encode(), headers)
        return urllib.request.urlopen(req, timeout=timeout_s)


@pytest.fixture(scope="session")
def swarm() -> Swarm:
    def get(name: str):
        return settings.read(os.environ, name, "tests")

    return Swarm(get("KNOT_SWARM_URL"), get("KNOT_SWARM_MANAGER"), cluster_secrets.read(get("KNOT_SWARM_SECRETS")),
                 get("KNOT_SWARM_NODES"))
