"""docker-compose.yml: valid against the compose spec, and the launcher's process set comes from it."""
import contextlib
import json
import re
from importlib import resources

import pytest
import yaml

from common.runtime import Context, Request
from deploy.launcher import Cluster, model_env, process_env
from deploy.local import compose
from deploy.local.host import load_service
from deploy.local.settings import HostSettings
from deploy.local.topology import Topology

ENV = {"KNOT_MODEL": "m.gguf", "KNOT_KEY": "m.knot"}


@pytest.fixture(scope="module")
def doc():
    return compose.load(compose.COMPOSE_FILE, ENV)


def test_compose_file_is_valid_against_the_compose_spec(doc):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema", reason="ships the compose-spec JSON schema (pip install check-jsonschema)")
    schema = json.loads((resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json").read_text())
    raw = yaml.safe_load(compose.COMPOSE_FILE.read_text())
    for d in (raw, doc):  # as written, and after variable substitution
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(d), key=str)
        assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_compose_shape(doc):
    services = doc["services"]
    ours = {n: s for n, s in services.items() if "build" in s}
    assert {s["build"]["dockerfile"] for s in ours.values()} == {"deploy/docker/Dockerfile"}  # one image
    assert (compose.REPO_ROOT / "deploy/docker/Dockerfile").is_file()
    assert services["minio"]["image"].startswith("minio/minio") and services["redis"]["image"].startswith("redis")
    for name, s in services.items():
        if name != "init":
            assert "healthcheck" in s, f"{name} has no healthcheck"
        # Only the coordinator's port is published.
        assert "ports" not in s or name == "coordinator", f"{name} publishes a port"
    assert services["init"]["depends_on"] == {"minio": {"condition": "service_healthy"}}
    for name in ("layer-warden", "cobordism-warden"):
        assert services[name]["depends_on"]["init"] == {"condition": "service_completed_successfully"}


def test_launch_plan_comes_from_the_file(doc):
    specs = compose.plan(doc)
    by_name = {s.name: s for s in specs}
    assert set(by_name) == set(doc["services"])
    assert (by_name["minio"].kind, by_name["redis"].kind) == ("seaweedfs", "redis")
    assert by_name["init"].oneshot and by_name["init"].command == ["python", "-m", "deploy.local.init"]
    order = [s.name for s in specs]
    for s in specs:
        for dep in s.depends_on:
            assert order.index(dep) < order.index(s.name)
    for s in specs:
        if s.kind == "process" and not s.oneshot:
            settings = HostSettings.from_env(s.environment)  # every service's env is a valid config
            svc = load_service(settings.service)
            assert set(settings.durable_objects) <= set(svc.durable_objects)
            assert s.healthcheck_url == "http://127.0.0.1:8080/readyz" and s.container_port == 8080
            # the public face logs every request; the internal hops (~10 per token) only failures
            assert settings.access_log == ("all" if s.name == "coordinator" else "errors"), s.name


def test_access_log_setting_is_checked():
    base = {"KNOT_SERVICE": "services.shard"}
    assert HostSettings.from_env(base).access_log == "all"
    assert HostSettings.from_env({**base, "KNOT_ACCESS_LOG": "errors"}).access_log == "errors"
    with pytest.raises(ValueError, match="KNOT_ACCESS_LOG"):
        HostSettings.from_env({**base, "KNOT_ACCESS_LOG": "verbose"})


def test_addresses_are_rewritten_to_local_ports(doc):
    specs = {s.name: s for s in compose.plan(doc)}
    addresses = {"minio": (9000, 41001), "redis": (6379, 41002), "cobordism-warden": (8080, 41003)}
    env = process_env(specs["cobordism-warden"], addresses, 41003, {"PATH": "/bin"})
    assert env["S3_ENDPOINT_URL"] == "http://127.0.0.1:41001"
    assert env["EMBED_CACHE"] == "redis://127.0.0.1:41002/0"
    assert (env["PORT"], env["HOST"], env["PATH"]) == ("41003", "127.0.0.1", "/bin")
    assert env["KNOT_KEY"] == "m.knot"
    assert compose.rewrite_addresses({"A": "do+http://cobordism-warden:8080/CobordismWarden",
                                      "B": "http://x-cobordism-warden:8080"}, addresses) == {
        "A": "do+http://127.0.0.1:41003/CobordismWarden", "B": "http://x-cobordism-warden:8080"}


def test_interpolation_and_model_overrides():
    assert compose.interpolate("${A:-x}/${B-y}/${C}/$$", {"A": "", "B": ""}) == "x///$"
    env = model_env("qwen2.5-coder-1.5b", {})
    assert {k: env[k] for k in ("KNOT_MODEL", "KNOT_KEY", "KNOT_N_LAYERS", "KNOT_SPLIT_LAYER", "KNOT_VOCAB_SIZE")} == {
        "KNOT_MODEL": "qwen2.5-coder-1.5b", "KNOT_KEY": "qwen2.5-coder-1.5b.knot", "KNOT_N_LAYERS": "28",
        "KNOT_SPLIT_LAYER": "14", "KNOT_VOCAB_SIZE": "151936"}
    assert [env[f"KNOT_SHARD_BOUND_{i}"] for i in range(1, 8)] == [str(18992 * i) for i in range(1, 8)]
    assert model_env("qwen2.5-coder-1.5b", {"KNOT_KEY": "k", "KNOT_N_LAYERS": "28", "KNOT_VOCAB_SIZE": "1"}) == {
        "KNOT_MODEL": "qwen2.5-coder-1.5b"}
    assert model_env(None, {})["KNOT_N_LAYERS"] == "24"  # the default 0.5B


def test_compose_shards_tile_any_vocabulary():
    """The shard bounds the launcher derives from the model tile its vocabulary in the compose file."""
    from common.topology import ShardSpec, check_vocab_tiling

    for vocab in (151_936, 270, 1000):
        env = {"KNOT_VOCAB_SIZE": str(vocab),
               **{f"KNOT_SHARD_BOUND_{i}": str(vocab * i // 8) for i in range(1, 8)}}
        specs = {s.name: s for s in compose.plan(compose.load(compose.COMPOSE_FILE, env))}
        shards = [ShardSpec(i, int(specs[f"shard-{i}"].environment["VOCAB_START"]),
                            int(specs[f"shard-{i}"].environment["VOCAB_END"])) for i in range(8)]
        check_vocab_tiling(shards, vocab)
        coord = specs["coordinator"].environment["SHARDS"].split(",")
        assert [c.split(":")[1] for c in coord] == [f"{s.vocab_start}-{s.vocab_end}" for s in shards]


def test_ports_are_allocated_per_serving_service(tmp_path, doc):
    specs = compose.plan(doc)
    cluster = Cluster(tmp_path)
    addresses = cluster.allocate(specs, base_port=42000)
    assert set(addresses) == {s.name for s in specs if s.container_port is not None and not s.oneshot}
    assert len({p for _, p in addresses.values()}) == len(addresses)
    assert addresses["redis"][0] == 6379 and all(re.fullmatch(r"420\d\d", str(p)) for _, p in addresses.values())


async def test_embedded_topology_runs_the_compose_services_in_process(tmp_path, doc):
    from common import wire
    from deploy.encoder import encode
    from tests.synth import write_tiny_gguf

    specs = compose.plan(doc)
    topo = Topology(specs, tmp_path)
    assert {s.name for s in topo.specs} == {"layer-warden", "cobordism-warden", "station-0", "station-1",
                                            "coordinator", *(f"shard-{i}" for i in range(8))}
    bucket = topo.bucket_dir("knots")
    bucket.mkdir(parents=True)
    encode(write_tiny_gguf(tmp_path / "t.gguf"), bucket / "m.knot", progress=False)
    async with contextlib.AsyncExitStack() as stack:
        runtimes = topo.open(stack)
        lw, cw = runtimes["layer-warden"], runtimes["cobordism-warden"]
        r = await lw.handler(Request("POST", "/configure", body=b'{"knot_key": "absent.knot", "layer_start": 0, '
                                                                 b'"layer_end": 1}'), lw.env, Context(lw.tasks.add))
        assert r.status == 404 and "absent.knot" in r.json()["message"]
        headers = {"X-Knot-Id": "m.knot", "X-Vocab-Start": "0", "X-Vocab-End": "100"}
        r = await cw.handler(Request("POST", "/tensors", headers, b'{"rows": [1, 2]}'), cw.env, Context(cw.tasks.add))
        assert [f.row_start for f in wire.decode_batch(r.body)] == [1, 2]
    # Leaving the stack drained the KV writes the warden registered with wait_until.
    assert cw.tasks.stats()["completed"] == 2
