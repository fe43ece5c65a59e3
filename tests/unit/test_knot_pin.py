"""Issue 52, item 2, in the deployment: the launcher pins every service of the model to the digest of
the knot init uploads (KNOT_DIGEST), compose passes the variable through, and init uploads the pinned
knot over any other object under the key (tests/unit/test_integrity_inprocess.py: the services refuse one)."""
from __future__ import annotations

import pytest

from common.knot import parse_header
from common.settings import ConfigError
from common.topology import ClusterLayout
from deploy import compose_writer, launcher
from deploy.encoder import encode
from deploy.local.init import upload_dir
from tests.tiny_gguf import TinySpec, write_tiny_gguf

PINNED = {"layer_warden", "cobordism_warden", "station", "shard", "coordinator", "init"}
SECRETS = {"KNOT_REDIS_PASSWORD": "generated", "KNOT_INTERNAL_SECRET": "k" * 43,
           "MINIO_ROOT_USER": "bucket-key", "MINIO_ROOT_PASSWORD": "bucket-secret-key"}


@pytest.fixture(scope="module")
def other_knot(tmp_path_factory):
    d = tmp_path_factory.mktemp("other")
    return encode(write_tiny_gguf(d / "other.gguf", TinySpec(seed=1)), d / "other.knot", progress=False) and \
        d / "other.knot"


def test_compose_passes_knot_digest_to_every_service_of_the_model_and_not_to_the_drafts_init():
    layout = ClusterLayout.build({"block_count": 4, "vocab_size": 99}, 2, 3, knot_key="m.knot", model_source="m",
                                 draft_knot_key="d.knot", draft_source="d")
    for s in layout.services:
        env = compose_writer.environment(s, layout)
        if s.role in PINNED and s.name != "init-draft":
            assert env["KNOT_DIGEST"] == "${KNOT_DIGEST:-}", s.name
        elif s.name == "init-draft":
            assert env["KNOT_DIGEST"] == "", "the draft model's init must not take the model's pin"
        else:
            assert "KNOT_DIGEST" not in env, s.name
    digest = "ab" * 32
    for spec in launcher.plan(layout, {**SECRETS, "KNOT_DIGEST": digest}):
        if spec.name in ("coordinator", "station-0", "shard-2", "layer-warden", "cobordism-warden", "init"):
            assert spec.environment["KNOT_DIGEST"] == digest, spec.name


def test_the_launcher_pins_the_digest_of_the_knot_init_uploads(tiny_knot):
    assert launcher.model_digest(str(tiny_knot)) == parse_header(tiny_knot.read_bytes()).digest


def test_init_uploads_the_pinned_knot_over_another_and_refuses_a_local_knot_without_the_pin(tiny_knot, other_knot,
                                                                                           tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    ours, theirs = (parse_header(p.read_bytes()).digest for p in (tiny_knot, other_knot))
    (bucket / "m.knot").write_bytes(other_knot.read_bytes())  # a valid knot, not the pinned one
    assert upload_dir(bucket, "m.knot", str(tiny_knot)).endswith("already present, not copying")  # no pin
    assert upload_dir(bucket, "m.knot", str(tiny_knot), ours).startswith("copied")
    assert (bucket / "m.knot").read_bytes() == tiny_knot.read_bytes()
    assert upload_dir(bucket, "m.knot", str(tiny_knot), ours).endswith("already present, not copying")
    (bucket / "m.knot").unlink()
    with pytest.raises(ConfigError, match=f"has digest {theirs}, KNOT_DIGEST pins {ours}"):
        upload_dir(bucket, "m.knot", str(other_knot), ours)
    assert not (bucket / "m.knot").exists()


def test_the_model_cache_encodes_again_a_cached_knot_of_format_version_1(tmp_path, monkeypatch):
    """`knot fetch-model --encode` (models.ensure_knot) notices a cached knot the reader refuses."""
    import os

    from deploy import models
    from tests.tiny_gguf import as_version_1

    monkeypatch.setenv("KNOT_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = models.ensure_knot(str(gguf))
    assert out == models.knot_cache_path(gguf) and parse_header(out.read_bytes()).version == 2
    current = out.read_bytes()
    as_version_1(out, out)
    os.utime(out, (gguf.stat().st_mtime + 10,) * 2)  # newer than the GGUF: only its version makes it stale
    assert models.ensure_knot(str(gguf)) == out
    assert out.read_bytes() == current
