"""The Swarm stack (`knot compose --swarm`, deploy/stack_writer.py): rendered from the same layout as
docker-compose.yml, with the cluster's secrets as Swarm secrets only, one overlay network, only the
coordinator published, replicas placed by node label, restart policies and memory limits kept.
scripts/test-swarm.sh deploys it on a Swarm of three nodes."""
from __future__ import annotations

import re

import yaml

from common.topology import ClusterLayout
from deploy import compose_writer, stack_writer
from deploy.cluster_secrets import SECRETS

HPARAMS = {"block_count": 4, "vocab_size": 1000}


def stack(replicas: int = 2) -> dict:
    return yaml.safe_load(stack_writer.render_text(ClusterLayout.build(HPARAMS, 2, 2, replicas=replicas)))


def test_every_service_of_the_layout_is_a_swarm_service_on_the_overlay():
    layout = ClusterLayout.build(HPARAMS, 2, 2, replicas=2)
    doc = stack()
    assert list(doc["services"]) == [s.name for s in layout.services]
    assert doc["networks"] == {"knot": {"driver": "overlay", "attachable": True}}
    for name, svc in doc["services"].items():
        assert svc["networks"] == ["knot"], name
        assert svc["image"].startswith("${KNOT_REGISTRY:-127.0.0.1:5000}/"), name
        assert "build" not in svc and "depends_on" not in svc and "restart" not in svc, name
        assert svc["deploy"]["replicas"] == 1 and svc["deploy"]["restart_policy"]["condition"] in ("any", "on-failure")
    published = [n for n, s in doc["services"].items() if "ports" in s]
    assert published == ["coordinator"]
    assert doc["services"]["init"]["deploy"]["restart_policy"]["condition"] == "on-failure"


def test_no_secret_is_in_any_environment_and_each_is_a_swarm_secret():
    doc = stack()
    assert set(doc["secrets"]) == {stack_writer.secret_name(n) for n in [*SECRETS, "KNOT_API_KEY"]}
    assert all(v == {"external": True} for v in doc["secrets"].values())
    for name, svc in doc["services"].items():
        env = svc.get("environment", {})
        assert not set(env) & set(stack_writer.SECRET_VARS), (name, env)
        for s in svc.get("secrets", []):
            assert s["source"] in doc["secrets"] and s["mode"] == 0o400, s
    targets = {n: {s["target"] for s in svc.get("secrets", [])} for n, svc in doc["services"].items()}
    assert targets["coordinator"] >= {"KNOT_INTERNAL_SECRET", "KNOT_API_KEY", "AWS_SECRET_ACCESS_KEY"}
    assert targets["redis"] == {"KNOT_REDIS_PASSWORD", "REDISCLI_AUTH"}
    assert targets["minio"] == {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}
    assert targets["cobordism-warden"] >= {"KNOT_REDIS_PASSWORD"}
    # the commands export them first: compose's command after the loader
    compose = compose_writer.render(ClusterLayout.build(HPARAMS, 2, 2, replicas=2))["services"]
    assert doc["services"]["station-1-r1"]["command"][4:] == compose["station-1-r1"]["command"]
    assert "/run/secrets/*" in doc["services"]["station-1-r1"]["command"][2]


def test_replica_k_runs_on_nodes_labelled_k_and_the_rest_on_managers():
    doc = stack(replicas=3)
    for name, svc in doc["services"].items():
        placement = svc["deploy"].get("placement", {})
        m = re.fullmatch(r"(station|shard)-\d+(?:-r(\d))?", name)
        if m:
            k = int(m[2] or 0)
            assert placement == {"constraints": [f"node.labels.knot.replica == {k}"], "max_replicas_per_node": 1}
        else:
            assert placement == {"constraints": ["node.role == manager"]}, name
    one = stack(replicas=1)
    assert "placement" not in one["services"]["station-0"]["deploy"]  # one replica: any node


def test_memory_limits_and_healthchecks_are_composes():
    layout = ClusterLayout.build(HPARAMS, 2, 2, replicas=2)
    compose = compose_writer.render(layout)["services"]
    doc = stack()
    for name, svc in doc["services"].items():
        if "mem_limit" in compose[name]:
            assert svc["deploy"]["resources"]["limits"]["memory"] == compose[name]["mem_limit"], name
        if name not in ("minio", "redis") and "healthcheck" in compose[name]:
            assert svc["healthcheck"] == compose[name]["healthcheck"], name
    # the stores' checks read their secrets from files, not from the environment
    assert "/run/secrets/KNOT_REDIS_PASSWORD" in " ".join(doc["services"]["redis"]["healthcheck"]["test"])
