"""docker-compose.yml: generated from the cluster layout, valid against the compose spec, and the
launcher's process set is the same rendering."""
import contextlib
import json
import re
from importlib import resources

import pytest
import yaml

from common.runtime import Context, Request
from common.topology import ClusterLayout, TopologyError
from deploy import compose_writer
from deploy.launcher import Cluster, choose_model, default_layout, layout_for, plan, process_env
from deploy.local import compose_reader
from deploy.local.host import load_service
from deploy.local.host_settings import HostSettings
from deploy.local.embedded_cluster import EmbeddedCluster

SECRETS = {"KNOT_REDIS_PASSWORD": "redis-password-of-the-test",  # what deploy/cluster_secrets.py generates
           "KNOT_INTERNAL_SECRET": "internal-calls-key-of-the-test-43-characters",
           "MINIO_ROOT_USER": "bucket-key-of-the-test", "MINIO_ROOT_PASSWORD": "bucket-secret-key-of-the-test"}
ENV = {"KNOT_MODEL": "m.gguf", "KNOT_KEY": "m.knot", **SECRETS}


@pytest.fixture(scope="module")
def doc():
    return compose_reader.load(compose_reader.COMPOSE_FILE, ENV)


def test_compose_file_is_valid_against_the_compose_spec(doc):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema", reason="ships the compose-spec JSON schema (pip install check-jsonschema)")
    schema = json.loads((resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json").read_text())
    raw = yaml.safe_load(compose_reader.COMPOSE_FILE.read_text())
    for d in (raw, doc):  # as written, and after variable substitution
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(d), key=str)
        assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_compose_shape(doc):
    services = doc["services"]
    ours = {n: s for n, s in services.items() if "build" in s}
    assert {s["build"]["dockerfile"] for s in ours.values()} == {"deploy/docker/Dockerfile"}  # one image
    assert (compose_reader.REPO_ROOT / "deploy/docker/Dockerfile").is_file()
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
    specs = compose_reader.plan(doc)
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
    specs = {s.name: s for s in compose_reader.plan(doc)}
    addresses = {"minio": (9000, 41001), "redis": (6379, 41002), "cobordism-warden": (8080, 41003)}
    env = process_env(specs["cobordism-warden"], addresses, 41003, {"PATH": "/bin"})
    assert env["S3_ENDPOINT_URL"] == "http://127.0.0.1:41001"
    assert env["EMBED_CACHE"] == "redis://127.0.0.1:41002/0"
    assert (env["PORT"], env["HOST"], env["PATH"]) == ("41003", "127.0.0.1", "/bin")
    assert process_env(specs["station-0"], addresses, None, {})["KNOT_KEY"] == "m.knot"  # ${KNOT_KEY} substituted
    assert compose_reader.rewrite_addresses({"A": "do+http://cobordism-warden:8080/CobordismWarden",
                                      "B": "http://x-cobordism-warden:8080"}, addresses) == {
        "A": "do+http://127.0.0.1:41003/CobordismWarden", "B": "http://x-cobordism-warden:8080"}


def test_the_local_init_uses_the_local_model_cache(doc, tmp_path, monkeypatch):
    """The init container's KNOT_CACHE_DIR is its volume (/cache); run locally, the process gets
    the local cache (where `knot fetch-model` put the model), not a path that does not exist."""
    specs = {s.name: s for s in compose_reader.plan(doc)}
    assert specs["init"].environment["KNOT_CACHE_DIR"] == "/cache"
    monkeypatch.setenv("KNOT_CACHE_DIR", str(tmp_path))
    assert process_env(specs["init"], {}, None, {})["KNOT_CACHE_DIR"] == str(tmp_path)
    assert "KNOT_CACHE_DIR" not in process_env(specs["station-0"], {}, None, {})


def test_committed_compose_file_is_generated_from_the_layout():
    """Fails when docker-compose.yml is stale: regenerate it with `knot compose > docker-compose.yml`."""
    want = compose_writer.render_text(default_layout(), choose_model(None, {}).source)
    assert compose_reader.COMPOSE_FILE.read_text() == want, \
        "docker-compose.yml is stale: run `knot compose > docker-compose.yml`"


def test_launcher_plans_what_the_file_says(doc):
    """The launcher's processes for the default layout are the committed file's, field for field."""
    assert plan(default_layout(), ENV) == compose_reader.plan(doc)


def test_interpolation_and_model_choice():
    assert compose_reader.interpolate("${A:-x}/${B-y}/${C}/$$", {"A": "", "B": ""}) == "x///$"
    choice = choose_model("qwen2.5-coder-1.5b", {})
    assert (choice.source, choice.knot_key) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b.knot")
    layout = layout_for(choice)
    assert [(s.layer_start, s.layer_end, s.role) for s in layout.stations] == [(0, 14, "entry"), (14, 28, "exit")]
    assert [s.vocab_start for s in layout.shards] == [18992 * i for i in range(8)] and layout.vocab_size == 151936
    specs = {s.name: s for s in plan(layout, {"KNOT_KEY": "k", **SECRETS})}  # an explicit KNOT_KEY wins over the model's
    assert specs["station-1"].environment["SPECIALIZATION_END_LAYER"] == "28"
    assert {specs[n].environment["KNOT_KEY"] for n in ("station-0", "shard-3", "coordinator", "init")} == {"k"}
    assert specs["init"].environment["KNOT_MODEL"] == "qwen2.5-coder-1.5b"
    assert choose_model(None, {}).hparams["block_count"] == 24  # the default 0.5B
    assert choose_model(None, {"KNOT_MODEL": "qwen2.5-coder-1.5b"}).knot_key == "qwen2.5-coder-1.5b.knot"


@pytest.mark.parametrize("n_stations, n_shards", [(1, 1), (2, 3), (3, 8), (24, 5)])
def test_layout_tiles_any_model_and_counts(n_stations, n_shards):
    """Any counts the model allows: the stations chain its layers, the shards tile its vocabulary, and
    the coordinator's STATIONS and SHARDS name exactly those services."""
    from common.topology import ShardSpec, StationSpec, check_station_chain, check_vocab_tiling

    for vocab in (151_936, 270, 1000):
        layout = ClusterLayout.build({"block_count": 24, "vocab_size": vocab}, n_stations, n_shards)
        specs = {s.name: s for s in plan(layout, SECRETS)}
        shards = [ShardSpec(i, int(specs[f"shard-{i}"].environment["VOCAB_START"]),
                            int(specs[f"shard-{i}"].environment["VOCAB_END"])) for i in range(n_shards)]
        check_vocab_tiling(shards, vocab)
        stations = [StationSpec(i, int(specs[f"station-{i}"].environment["SPECIALIZATION_START_LAYER"]),
                                int(specs[f"station-{i}"].environment["SPECIALIZATION_END_LAYER"]),
                                specs[f"station-{i}"].environment["SPECIALIZATION_ROLE"]) for i in range(n_stations)]
        check_station_chain(stations, 24)
        assert [s.role for s in stations] == (["solo"] if n_stations == 1 else
                                              ["entry", *["middle"] * (n_stations - 2), "exit"])
        coord = specs["coordinator"]
        assert coord.environment["SHARDS"].split(",") == [f"SHARD_{s.index}:{s.vocab_start}-{s.vocab_end}"
                                                          for s in shards]
        assert coord.environment["STATIONS"] == ",".join(f"STATION_{i}" for i in range(n_stations))
        peers = {f"station-{i}" for i in range(n_stations)} | {f"shard-{i}" for i in range(n_shards)}
        assert set(coord.depends_on) == peers
        assert set(specs) == peers | {"minio", "redis", "init", "layer-warden", "cobordism-warden", "coordinator"}


def test_counts_the_model_does_not_allow_fail_clearly():
    hp = {"block_count": 24, "vocab_size": 1000}
    with pytest.raises(TopologyError, match="25 stations for 24 layers"):
        ClusterLayout.build(hp, 25, 8)
    with pytest.raises(TopologyError, match="0 stations for 24 layers"):
        ClusterLayout.build(hp, 0, 8)
    with pytest.raises(TopologyError, match="1001 shards for a vocabulary of 1000"):
        ClusterLayout.build(hp, 2, 1001)


def test_ports_are_allocated_per_serving_service(tmp_path, doc):
    specs = compose_reader.plan(doc)
    cluster = Cluster(tmp_path)
    addresses = cluster.allocate(specs, base_port=42000)
    assert set(addresses) == {s.name for s in specs if s.container_port is not None and not s.oneshot}
    assert len({p for _, p in addresses.values()}) == len(addresses)
    assert addresses["redis"][0] == 6379 and all(re.fullmatch(r"420\d\d", str(p)) for _, p in addresses.values())


async def test_embedded_topology_runs_the_compose_services_in_process(tmp_path, doc):
    from common import wire
    from deploy.encoder import encode
    from tests.tiny_gguf import write_tiny_gguf

    specs = compose_reader.plan(doc)
    cluster = EmbeddedCluster(specs, tmp_path)
    assert {s.name for s in cluster.specs} == {"layer-warden", "cobordism-warden", "station-0", "station-1",
                                            "coordinator", *(f"shard-{i}" for i in range(8))}
    bucket = cluster.bucket_dir("knots")
    bucket.mkdir(parents=True)
    encode(write_tiny_gguf(tmp_path / "t.gguf"), bucket / "m.knot", progress=False)
    async with contextlib.AsyncExitStack() as stack:
        runtimes = cluster.open(stack)
        lw, cw = runtimes["layer-warden"], runtimes["cobordism-warden"]
        r = await lw.handler(Request("POST", "/configure", body=b'{"knot_key": "absent.knot", "layer_start": 0, '
                                                                 b'"layer_end": 1}'), lw.env, Context(lw.tasks.add))
        assert r.status == 404 and "absent.knot" in r.json()["message"]
        headers = {"X-Knot-Id": "m.knot", "X-Vocab-Start": "0", "X-Vocab-End": "100"}
        r = await cw.handler(Request("POST", "/tensors", headers, b'{"rows": [1, 2]}'), cw.env, Context(cw.tasks.add))
        assert [f.row_start for f in wire.decode_batch(r.body)] == [1, 2]
    # Leaving the stack drained the KV writes the warden registered with wait_until.
    assert cw.tasks.stats()["completed"] == 2


def test_binding_urls_are_parsed_in_one_place():
    from deploy.local.host_settings import BindingURL, ConfigError, open_binding, parse_binding

    assert parse_binding("B", "s3://knots/") == BindingURL("B", "s3://knots/", "s3", "knots")
    assert parse_binding("B", "dir:/tmp/b") == BindingURL("B", "dir:/tmp/b", "dir", "/tmp/b")
    assert parse_binding("KV", "redis://r:6379/2?prefix=p:") == BindingURL(
        "KV", "redis://r:6379/2?prefix=p:", "redis", "redis://r:6379/2", "r", prefix="p:")
    assert parse_binding("KV", "memory:").prefix == "KV:"  # default: the binding's name
    assert parse_binding("NS", "do+http://w:8080/LayerWarden") == BindingURL(
        "NS", "do+http://w:8080/LayerWarden", "do+http", "LayerWarden", "w", "http://w:8080", peer="w")
    assert parse_binding("NS", "do+local:LayerWarden").target == "LayerWarden"
    assert parse_binding("S", "http://station-0:8080").host == "station-0"
    with pytest.raises(ConfigError, match="unknown scheme 'ftp'"):
        parse_binding("S", "ftp://x")
    with pytest.raises(ConfigError, match="cannot open redis bindings"):
        open_binding("KV", "redis://r:6379/0", {"s3": lambda b: b})


def test_knot_compose_writes_the_layout_for_any_counts(capsys):
    from deploy.cli import main

    assert main(["compose", "--stations", "3", "--shards", "3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# GENERATED") and "#   knot compose --stations 3 --shards 3 > docker-compose.yml" in text
    specs = {s.name: s for s in compose_reader.plan(compose_reader.interpolate(yaml.safe_load(text), SECRETS))}
    assert [specs[f"station-{i}"].environment["SPECIALIZATION_END_LAYER"] for i in range(3)] == ["8", "16", "24"]
    assert "shard-3" not in specs and specs["coordinator"].environment["STATIONS"] == "STATION_0,STATION_1,STATION_2"
    assert main(["compose", "--stations", "25"]) == 1
    assert "25 stations for 24 layers: need 1 <= stations <= layers" in capsys.readouterr().err


def test_cluster_up_refuses_counts_the_model_does_not_allow_before_starting(tmp_path):
    cluster = Cluster(tmp_path)
    with pytest.raises(TopologyError, match="0 shards for a vocabulary of 151936"):
        cluster.up(n_shards=0, env={})
    assert not cluster.state_path.exists() and not (tmp_path / "logs").exists()  # nothing was started


def test_redis_requires_the_cluster_password_in_compose(doc):
    """Redis gets the generated password from the environment (.env), never from its argv; the
    clients of the KV get it as KNOT_REDIS_PASSWORD, not in their binding URL; without it compose
    and the launcher refuse to start."""
    raw = yaml.safe_load(compose_reader.COMPOSE_FILE.read_text())["services"]
    required = "${KNOT_REDIS_PASSWORD:?"
    assert raw["redis"]["environment"]["KNOT_REDIS_PASSWORD"].startswith(required)
    assert raw["redis"]["environment"]["REDISCLI_AUTH"].startswith(required)  # the healthcheck's redis-cli
    command = " ".join(raw["redis"]["command"])
    assert "requirepass" in command and "$$KNOT_REDIS_PASSWORD" in command  # expanded by the container's sh
    assert "exec redis-server /tmp/redis.conf" in command  # redis-server's argv: a file, not the password
    assert raw["cobordism-warden"]["environment"]["KNOT_REDIS_PASSWORD"].startswith(required)
    assert raw["cobordism-warden"]["environment"]["EMBED_CACHE"] == "redis://redis:6379/0"
    services = doc["services"]
    assert services["cobordism-warden"]["environment"]["KNOT_REDIS_PASSWORD"] == SECRETS["KNOT_REDIS_PASSWORD"]
    for name, svc in services.items():  # only the KV's users carry it
        has = "KNOT_REDIS_PASSWORD" in (svc.get("environment") or {})
        assert has == (name in ("redis", "cobordism-warden")), name
    keys = {k: SECRETS[k] for k in ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD")}  # the bucket's (test_closed_bucket.py)
    with pytest.raises(compose_reader.ComposeError, match="KNOT_REDIS_PASSWORD is not set: .*knot secrets"):
        plan(default_layout(), {"KNOT_MODEL": "m.gguf", "KNOT_KEY": "m.knot", **keys})
    # nor without the internal calls' signing key: a compose cluster never runs unauthenticated
    with pytest.raises(compose_reader.ComposeError, match="KNOT_INTERNAL_SECRET is not set: .*knot secrets"):
        plan(default_layout(), {"KNOT_MODEL": "m.gguf", "KNOT_KEY": "m.knot", **keys,
                                "KNOT_REDIS_PASSWORD": SECRETS["KNOT_REDIS_PASSWORD"]})
    for name, svc in raw.items():  # every one of our services requires it
        if "KNOT_SERVICE" in (svc.get("environment") or {}):
            assert svc["environment"]["KNOT_INTERNAL_SECRET"].startswith("${KNOT_INTERNAL_SECRET:?"), name
    assert compose_reader.interpolate("${A:?why}/${B?because}", {"A": "a", "B": ""}) == "a/"
    with pytest.raises(compose_reader.ComposeError, match="B is not set: because"):
        compose_reader.interpolate("${B?because}", {})


def test_a_host_with_a_redis_binding_needs_the_password():
    from deploy.local.host_settings import ConfigError

    base = {"KNOT_SERVICE": "services.cobordism_warden", "KNOT_BINDINGS": "EMBED_CACHE",
            "EMBED_CACHE": "redis://127.0.0.1:6379/0"}
    with pytest.raises(ConfigError, match="KNOT_REDIS_PASSWORD.*EMBED_CACHE"):
        HostSettings.from_env(base)
    settings = HostSettings.from_env({**base, **SECRETS})
    assert settings.redis_password == SECRETS["KNOT_REDIS_PASSWORD"]
    assert SECRETS["KNOT_REDIS_PASSWORD"] not in repr(settings)  # a logged settings object does not leak it
    assert HostSettings.from_env({"KNOT_SERVICE": "services.shard"}).redis_password is None  # no Redis: none needed


def test_cluster_secrets_are_generated_once_private_and_kept(tmp_path, capsys):
    import os
    import stat

    from deploy import cluster_secrets
    from deploy.cli import main

    path = tmp_path / "run" / "secrets.env"
    first = cluster_secrets.ensure(path)
    assert set(first) == set(cluster_secrets.SECRETS) and len(first["KNOT_REDIS_PASSWORD"]) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert cluster_secrets.ensure(path) == first  # reused on restart
    assert cluster_secrets.ensure(tmp_path / "other.env") != first  # per cluster
    path.write_text(path.read_text() + "KNOT_PORT=9000\n")
    os.chmod(path, 0o644)
    with pytest.raises(cluster_secrets.SecretsError, match="readable by other users"):
        cluster_secrets.ensure(path)
    os.chmod(path, 0o600)
    path.write_text("KNOT_PORT=9000\n")  # a .env of the user's own: kept, the secret added
    added = cluster_secrets.ensure(path)
    assert cluster_secrets.read(path) == {"KNOT_PORT": "9000", **added}
    # `knot secrets` writes .env for docker compose and names what it holds, never the values
    env_file = tmp_path / ".env"
    assert main(["secrets", "--file", str(env_file)]) == 0
    values = cluster_secrets.read(env_file)
    assert values["KNOT_REDIS_PASSWORD"] and stat.S_IMODE(env_file.stat().st_mode) == 0o600
    out = capsys.readouterr()
    assert "KNOT_REDIS_PASSWORD" in out.out and values["KNOT_REDIS_PASSWORD"] not in out.out + out.err


def test_a_draft_model_adds_its_init_job_and_the_drafter_bound_to_the_coordinator(capsys):
    from deploy.cli import main

    assert main(["compose", "--model", "qwen2.5-coder-1.5b", "--draft-model", "qwen2.5-coder-0.5b"]) == 0
    text = capsys.readouterr().out
    assert "#   knot compose --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b >" in text
    specs = {s.name: s for s in compose_reader.plan(compose_reader.interpolate(yaml.safe_load(text), SECRETS))}
    init, drafter, co = specs["init-draft"], specs["drafter"], specs["coordinator"]
    assert (init.environment["KNOT_MODEL"], init.environment["KNOT_KEY"]) == \
        ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b.knot") and init.oneshot
    assert drafter.environment["KNOT_SERVICE"] == "services.drafter"
    assert drafter.environment["KNOT_KEY"] == "qwen2.5-coder-0.5b.knot"
    assert co.environment["DRAFTER"] == "http://drafter:8080" and "DRAFTER" in co.environment["KNOT_BINDINGS"]
    names = [s.name for s in compose_reader.plan(compose_reader.interpolate(yaml.safe_load(text), SECRETS))]
    assert names.index("init-draft") < names.index("drafter") < names.index("coordinator")
    doc = compose_reader.interpolate(compose_writer.render(default_layout()), SECRETS)
    plain = {s.name for s in compose_reader.plan(doc)}
    assert "drafter" not in plain and "init-draft" not in plain, "no draft model, no drafter"
    wrong = choose_model(None, {})
    wrong = type(wrong)(wrong.source, "x.knot", {**wrong.hparams, "vocab_size": 1000})
    with pytest.raises(TopologyError, match="must share the tokenizer"):
        layout_for(choose_model(None, {}), 2, 8, wrong)
