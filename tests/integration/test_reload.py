"""`knot cluster reload`: the operator's way to serve another knot under the same key once the pin
(issue 52, item 2) refuses it. The launched cluster is pinned to the model it uploaded; reload uploads
the new one and pins every service to its digest."""
from __future__ import annotations

import json
import os
from dataclasses import replace

from common.knot import parse_header
from common.sampling import SamplingParams
from deploy.encoder import encode
from deploy.engine_local import LocalEngine
from deploy import servers
from tests.integration.conftest import SPEC, http, knot_cli as cluster_cli
from tests.tiny_gguf import write_tiny_gguf

PROMPT = "the def the"
N = 6


def knot_cli(run_dir, *args, port: int, timeout_s=300):
    """`knot cluster ...` with the coordinator on its own port: another cluster on this machine (the
    default KNOT_PORT's) could answer for it and serve the same test knot."""
    return cluster_cli(run_dir, *args, timeout_s=timeout_s, env={**os.environ, "KNOT_PORT": str(port)})


def reference(path) -> list[int]:
    e = LocalEngine.open(path)
    return e.generate(e.tokenizer.encode(PROMPT), SamplingParams(), max_tokens=N).token_ids


def served(url: str) -> tuple[str, list[int]]:
    _, _, raw = http("GET", url + "/v1/models")
    code, _, body = http("POST", url + "/generate", {"prompt": PROMPT, "max_tokens": N}, timeout_s=120)
    assert code == 200, body
    return json.loads(raw)["data"][0]["knot_digest"], json.loads(body)["tokens"]


def test_reload_serves_a_new_knot_under_the_same_key_pinned_to_its_digest(tmp_path, knot):
    newer = tmp_path / "newer" / knot.path.name  # the same file name: the same key in the bucket
    newer.parent.mkdir()
    encode(write_tiny_gguf(tmp_path / "newer.gguf", replace(SPEC, seed=1)), newer, progress=False)
    ours, theirs = parse_header(knot.data).digest, parse_header(newer.read_bytes()).digest
    run_dir, port = tmp_path / "cluster", servers.free_ports(1)[0]
    up = knot_cli(run_dir, "up", "--model", str(knot.path), port=port)
    try:
        assert up.returncode == 0, up.stderr
        assert served(up.stdout.strip().splitlines()[-1]) == (ours, reference(knot.path))
        reload = knot_cli(run_dir, "reload", "--model", str(newer), port=port)
        assert reload.returncode == 0, reload.stderr
        init_log = (run_dir / "logs" / "init.log").read_text()
        assert f"KNOT_DIGEST pins {theirs}: uploading again" in init_log  # the bucket held the old one
        assert served(reload.stdout.strip().splitlines()[-1]) == (theirs, reference(newer))
    finally:
        assert knot_cli(run_dir, "down", port=port).returncode == 0
