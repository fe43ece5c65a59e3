"""The model registry (common/models/): model_for() is the one way in, an unknown architecture
fails at boot naming itself and the known ones, and the resident rule is the one every holder of
tensors used to write for itself."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.models import ARCHITECTURES, UnknownArchitecture, model_for
from common.models.qwen2 import Qwen2
from common.runtime import Request
from deploy.encoder import encode
from deploy.engine_local import LocalEngine
from deploy.knotfile import open_model
from services.layer_warden.layer_warden import resident_rule
from tests.inprocess import KNOT_KEY, build_cluster
from tests.tiny_gguf import TinySpec, write_tiny_gguf

KNOWN = ", ".join(sorted(ARCHITECTURES))


@dataclass
class Header:
    architecture: str
    hparams: dict


@pytest.fixture(scope="module")
def llama_knot(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    g = write_tiny_gguf(d / "llama.gguf", TinySpec(arch="llama"))
    encode(g, d / "llama.knot", progress=False)
    return d / "llama.knot"


def test_model_for_binds_the_architecture_to_the_headers_hyperparameters(tiny_knot):
    header = open_model(tiny_knot).header
    model = model_for(header)
    assert isinstance(model, Qwen2) and model.architecture == header.architecture == "qwen2"
    cfg, hp = model.cfg, header.hparams
    assert (cfg.n_layer, cfg.dim, cfg.ffn_dim, cfg.n_head, cfg.n_kv_head, cfg.vocab_size, cfg.context_length) == (
        hp["block_count"], hp["embedding_length"], hp["feed_forward_length"], hp["head_count"],
        hp["head_count_kv"], hp["vocab_size"], hp["context_length"])
    with pytest.raises(ValueError, match="head_dim"):
        model_for(Header("qwen2", hp | {"head_count": 5}))


def test_an_unknown_architecture_names_itself_and_the_known_ones():
    with pytest.raises(UnknownArchitecture) as e:
        model_for(Header("mamba", {}))
    assert str(e.value) == f"architecture 'mamba' is not supported; the model registry knows {KNOWN} (common/models/)"
    assert isinstance(e.value, ValueError)


def test_the_single_process_refuses_an_unknown_architecture_when_it_opens(llama_knot):
    with pytest.raises(UnknownArchitecture, match=f"architecture 'llama' is not supported; .* knows {KNOWN}"):
        LocalEngine.open(llama_knot)


async def test_every_service_refuses_an_unknown_architecture_at_boot(tiny_knot, llama_knot, tmp_path):
    """A llama knot in the bucket: each service's boot fails with a 503 naming the architecture."""
    from services.coordinator import handler as coordinator
    from services.shard import handler as shard
    from services.station import handler as station

    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    await c.bucket.put(KNOT_KEY, llama_knot.read_bytes())
    for svc in (station, shard, coordinator):
        svc._booted.clear()
    want = f"knot '{KNOT_KEY}': architecture 'llama' is not supported; the model registry knows {KNOWN}"
    replies = [await c.stations[0].fetch(Request("GET", "/stats")),
               await c.shards[0].fetch(Request("GET", "/stats")),
               await c.generate(prompt="the", max_tokens=1),
               await c.layer_wardens.fetch("LayerWarden", f"{KNOT_KEY}|0-2", Request(
                   "POST", "/configure", {}, b'{"knot_key": "model.knot", "layer_start": 0, "layer_end": 2}'))]
    for r in replies:
        assert r.status == 503 and want in r.json()["message"], r.body
    await c.drain()


def test_the_resident_rule_is_the_one_each_holder_wrote(tiny_knot):
    """Before the registry: the station kept `.bias` and `norm` tensors, the single process cached
    all but those, the layer warden pinned `norm`, the tensors outside the layers and anything
    under 1 MiB. One rule now gives all three (the warden now also pins biases of any size: a
    Qwen2 bias is at most hidden * 4 bytes, 14 KiB for a 7B, always under the 1 MiB anyway)."""
    header = open_model(tiny_knot).header
    model = model_for(header)
    names = list(header.tensors)
    layer_names = [n for l in range(model.cfg.n_layer) for n in model.layer_tensors(l)]
    assert sorted(layer_names) == sorted(n for n in names if n.startswith("blk.")), "each layer tensor, once"
    for n in layer_names:
        assert model.is_resident(n) == (n.endswith(".bias") or "norm" in n), n
    assert model.is_resident(model.OUTPUT_NORM) and not model.is_resident(model.TOKEN_EMBD)
    pinned = resident_rule(model)
    old = frozenset({"token_embd.weight", "output_norm.weight", "output.weight"})
    for n in names:
        for nbytes in {header.tensors[n].length, 10 << 20} - ({10 << 20} if n.endswith(".bias") else set()):
            assert pinned(n, nbytes) == ("norm" in n or n in old or nbytes < 1 << 20), (n, nbytes)


def test_the_head_falls_back_to_the_tied_embedding(tiny_knot):
    model = model_for(open_model(tiny_knot).header)
    assert model.head_tensor(lambda n: True) == "output.weight"
    assert model.head_tensor(lambda n: False) == "token_embd.weight"
