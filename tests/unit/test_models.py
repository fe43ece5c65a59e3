"""Model registry and cache resolution (no network)."""
from __future__ import annotations

import pytest

from deploy import models


def test_registry_is_complete():
    for spec in models.MODELS.values():
        assert len(spec.sha256) == 64 and spec.size_bytes > 0 and spec.n_parts > 0
        assert spec.member.format(n=3).endswith("part03.bin")
    assert models.DEFAULT_MODEL in models.MODELS


def test_cache_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("KNOT_CACHE_DIR", str(tmp_path))
    assert models.cache_dir() == tmp_path
    with pytest.raises(models.ModelError, match="knot fetch-model qwen2.5-coder-0.5b"):
        models.model_path("qwen2.5-coder-0.5b")


def test_unknown_model_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("KNOT_CACHE_DIR", str(tmp_path))
    with pytest.raises(models.ModelError, match="qwen9: neither a file nor a known model"):
        models.fetch("qwen9")


def test_local_gguf_is_accepted(tiny_gguf):
    assert models.fetch(str(tiny_gguf)) == tiny_gguf
    assert models.model_path(str(tiny_gguf)) == tiny_gguf
