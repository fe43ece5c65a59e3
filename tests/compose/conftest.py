"""The containers of docker-compose.yml, as scripts/test-compose.sh brought them up.

That script starts the engine, builds the images, runs `docker compose up -d --wait`, exports
COMPOSE_FILE, COMPOSE_PROJECT_NAME and KNOT_PORT (so every `docker compose` here addresses the same
stack), runs `pytest -m compose tests/compose` and always takes the stack down. Without it
(KNOT_COMPOSE_STACK unset) these tests skip: they never start or stop a stack themselves.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import pytest

from common import settings
from tests.integration.conftest import http, metric

MODEL = "qwen2.5-coder-0.5b"


def pytest_collection_modifyitems(config, items):
    if settings.read(os.environ, "KNOT_COMPOSE_STACK", "tests") == "1":
        return
    skip = pytest.mark.skip(reason="no compose stack: scripts/test-compose.sh brings one up and runs these")
    for item in items:
        if "compose" in item.keywords:
            item.add_marker(skip)


class Stack:
    """The running compose project, reached from the host: `docker compose`, `docker` and the one
    published port."""

    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.port = port

    def compose(self, *args: str, timeout_s: float = 300) -> str:
        return subprocess.run(["docker", "compose", *args], check=True, capture_output=True, text=True,
                              timeout=timeout_s).stdout

    def docker(self, *args: str, timeout_s: float = 300) -> str:
        return subprocess.run(["docker", *args], check=True, capture_output=True, text=True,
                              timeout=timeout_s).stdout

    def container(self, service: str) -> str:
        """The id of the service's container (running or not)."""
        ids = self.compose("ps", "-a", "-q", service).split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, service: str) -> dict:
        return json.loads(self.docker("inspect", self.container(service)))[0]

    def services(self) -> list[str]:
        return self.compose("config", "--services").split()

    def wait_healthy(self, service: str, timeout_s: float = 180, after_restarts: int = 0) -> dict:
        """Wait until the service's container has restarted more than after_restarts times (when
        given) and is healthy again; return its inspect document."""
        deadline = time.monotonic() + timeout_s
        while True:
            doc = self.inspect(service)
            state = doc["State"]
            if doc["RestartCount"] >= after_restarts and state["Running"] and \
                    state.get("Health", {}).get("Status") == "healthy":
                return doc
            if time.monotonic() > deadline:
                raise AssertionError(f"{service} not healthy within {timeout_s} s: {json.dumps(state)}")
            time.sleep(0.5)

    def generate(self, timeout_s: float = 600, **body) -> dict:
        status, _, raw = http("POST", self.url + "/generate", body, timeout_s=timeout_s)
        assert status == 200, raw
        return json.loads(raw)

    def metric(self, name: str) -> float:
        """The sum of a coordinator metric's samples (all labels)."""
        return metric(self.url, name)


@pytest.fixture(scope="session")
def stack() -> Stack:
    return Stack(settings.read(os.environ, "KNOT_PORT", "tests"))


@pytest.fixture(scope="session")
def knot_generate():
    """knot_generate(prompt, max_tokens, chat=False) -> the JSON of `knot generate MODEL PROMPT --json`
    (greedy) on the host: the single-process reference."""

    @functools.lru_cache(maxsize=None)
    def run(prompt: str, max_tokens: int, chat: bool = False) -> dict:
        cmd = [sys.executable, "-m", "deploy.cli", "generate", MODEL, prompt, "--max-tokens", str(max_tokens),
               "--json"] + (["--chat"] if chat else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
        return json.loads(out)

    return run


@pytest.fixture(scope="session")
def tokenizer():
    from common.tokenizer import Tokenizer
    from deploy import models
    from deploy.knotfile import open_model

    return Tokenizer(open_model(models.model_path(MODEL)).tokenizer_data())
