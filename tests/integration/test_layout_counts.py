"""`knot cluster up --stations N --shards M` for counts other than 2 and 8: the layout's processes for
1, 3 and 8 shards and 2 and 3 stations, on real SeaweedFS, Valkey and the session's wardens, give the
token ids of the default layout (2 stations, 8 shards), which are the single-process engine's."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.sampling import SamplingParams
from deploy import launcher, servers
from deploy.encoder import encode
from deploy.engine_local import LocalEngine
from tests.integration.conftest import http
from tests.tiny_gguf import TinySpec, write_tiny_gguf

KNOT_KEY = "counts.knot"
LAYOUTS = [(2, 8), (2, 1), (3, 3)]  # (stations, shards); the default first
PROMPT = "the def the"
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=3)


@pytest.fixture(scope="module")
def counts_knot(tmp_path_factory, s3_settings):
    """Three layers, so that three stations each get one; the rest as small as the test model allows."""
    from deploy.local.server_bindings import s3_client

    d = tmp_path_factory.mktemp("counts")
    path = d / "counts.knot"
    encode(write_tiny_gguf(d / "counts.gguf", TinySpec(n_layers=3, seed=5)), path, progress=False)
    s3_client(s3_settings).upload_file(str(path), "knots", KNOT_KEY)
    return path


@pytest.fixture(scope="module")
def layouts(procs, counts_knot, run_dir):
    """Every layout of LAYOUTS started at once (the shared wardens, S3 and Redis), then waited for."""
    choice = launcher.choose_model(str(counts_knot), {})
    started: list[launcher.Running] = []
    urls = {}
    try:
        pending = []
        for n_stations, n_shards in LAYOUTS:
            specs = [s for s in launcher.plan(launcher.layout_for(choice, n_stations, n_shards),
                                              {**procs.env, "KNOT_KEY": KNOT_KEY})
                     if s.kind == "process" and not s.oneshot and s.name not in procs.addresses]
            addresses = {**procs.addresses}
            for s, port in zip(specs, servers.free_ports(len(specs))):
                addresses[s.name] = (8080, port)
            for s in specs:
                r = launcher.start_process(s, addresses, run_dir / f"counts-{n_stations}x{n_shards}")
                started.append(r)
                pending.append(r)
            urls[(n_stations, n_shards)] = f"http://127.0.0.1:{addresses['coordinator'][1]}"
        for r in pending:
            launcher.wait_ready(r, f"http://127.0.0.1:{r.port}/readyz", timeout_s=120)
        yield urls
    finally:  # SIGTERM all at once: each drains on its own
        with ThreadPoolExecutor(len(started) or 1) as pool:
            list(pool.map(lambda r: servers.stop_pid(r.pid, launcher.PROCESS_STOP_TIMEOUT_S), started))


def generate(url: str, **body) -> dict:
    status, _, raw = http("POST", url + "/generate", {"prompt": PROMPT, "max_tokens": 12, **body}, timeout_s=120)
    assert status == 200, raw
    return json.loads(raw)


def test_any_counts_give_the_default_layouts_tokens(layouts, counts_knot):
    engine = LocalEngine.open(counts_knot)
    ids = engine.tokenizer.encode(PROMPT)
    want = engine.generate(ids, SamplingParams(), max_tokens=12).token_ids
    want_sampled = engine.generate(ids, SamplingParams(**SAMPLED), max_tokens=12).token_ids
    default = generate(layouts[LAYOUTS[0]])
    assert default["tokens"] == want
    for counts, url in layouts.items():
        status, _, raw = http("GET", url + "/topology")
        topology = json.loads(raw)
        assert status == 200 and (len(topology["stations"]), len(topology["shards"])) == counts, topology
        body = generate(url)
        assert body["tokens"] == default["tokens"], counts
        assert body["degraded_shards"] == [] and body["replays"] == 0
        assert generate(url, **SAMPLED)["tokens"] == want_sampled, counts
