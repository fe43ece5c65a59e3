"""The one layer loop (common/layers.py): bit for bit the phase sequence the station used to write
out by hand, with sync or async weights; and every runner (the single process, the stations of the
in-process cluster) runs its phases through it."""
from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest

from common import layers
from common.kvcache import KVCache
from common.models import MissingTensorError, model_for
from common.models.qwen2 import Qwen2, attn_phase_batch, ffn_down_phase, ffn_gate_phase, ffn_up_phase
from common.sync import WouldSuspend, iterate_sync, run_sync
from deploy.engine_local import LocalEngine
from tests.inprocess import build_cluster


@pytest.fixture(scope="module")
def engine(tiny_knot):
    return LocalEngine.open(tiny_knot, cache_f32=False)


def old_station_forward(ops, cfg, h, layer_start, layer_end, load, seqs):
    """The station's loop before common/layers.py (services/station/handler.py, _forward), verbatim
    but for the loads."""
    for l in range(layer_start, layer_end):
        w = load(l, "attn")
        h = attn_phase_batch(ops, cfg, l, h, w, seqs)
        w = load(l, "ffn_gate")
        st = ffn_gate_phase(ops, cfg, l, h, w)
        w = load(l, "ffn_up")
        st = ffn_up_phase(ops, cfg, l, st, w)
        w = load(l, "ffn_down")
        h = ffn_down_phase(ops, cfg, l, st, w)
    return h


def batch(engine, lens, seed=0):
    """Sequences with (already cached, new) rows: their KV caches filled, their new rows stacked."""
    rng = np.random.default_rng(seed)
    dim = engine.cfg.dim
    seqs, xs = [], []
    for n_old, n_new in lens:
        kv = engine.new_kv()
        if n_old:
            layers.forward_range(engine.arch, rng.normal(size=(n_old, dim)).astype(np.float32) * 0.1, 0,
                                 engine.cfg.n_layer, engine.load_phase, kv, np.arange(n_old))
        seqs.append((kv, np.arange(n_old, n_old + n_new)))
        xs.append(rng.normal(size=(n_new, dim)).astype(np.float32) * 0.1)
    return np.concatenate(xs), seqs


def kv_arrays(kv):
    """layer -> (keys, values, positions) held so far."""
    return {l: (kv._k[l][:n], kv._v[l][:n], kv._pos[l][:n]) for l, n in kv._n.items()}


def copy_seqs(seqs):
    out = []
    for kv, pos in seqs:
        c = KVCache(kv.n_kv_head, kv.head_dim)
        for l, (k, v, p) in kv_arrays(kv).items():
            c.append(l, k, v, p)
        out.append((c, pos))
    return out


class SyncWeights:
    def __init__(self, engine):
        self.engine, self.log = engine, []

    def load(self, layer, phase):
        self.log.append(("load", layer, phase))
        return self.engine.load_phase(layer, phase)

    def done(self, layer, phase, w):
        self.log.append(("done", layer, phase))


class AsyncWeights(SyncWeights):
    async def load(self, layer, phase):
        await asyncio.sleep(0)  # really suspends: a network load
        return super().load(layer, phase)


@pytest.mark.parametrize("lens", [[(0, 5)], [(4, 1), (0, 3), (9, 1)]])
@pytest.mark.parametrize("span", [(0, 2), (1, 2)])
async def test_loop_equals_the_old_phase_sequence_bit_for_bit(engine, lens, span):
    x, seqs = batch(engine, lens)
    a, b = span
    old_seqs, sync_seqs, async_seqs = copy_seqs(seqs), copy_seqs(seqs), copy_seqs(seqs)
    want = old_station_forward(engine.arch.ops, engine.cfg, x.copy(), a, b, engine.load_phase, old_seqs)
    got_sync = run_sync(layers.run_layers(engine.arch, x.copy(), a, b, sync_seqs, SyncWeights(engine)))
    w = AsyncWeights(engine)
    got_async = await layers.run_layers(engine.arch, x.copy(), a, b, async_seqs, w)
    np.testing.assert_array_equal(got_sync, want)
    np.testing.assert_array_equal(got_async, want)
    for kvs in (sync_seqs, async_seqs):
        for (kv, _), (old, _) in zip(kvs, old_seqs):
            got, want_kv = kv_arrays(kv), kv_arrays(old)
            assert got.keys() == want_kv.keys()
            for l in got:
                for g, o in zip(got[l], want_kv[l]):
                    np.testing.assert_array_equal(g, o)
    # each phase is loaded, run and let go before the next is loaded
    assert w.log == [(ev, l, p) for l in range(a, b) for p in engine.arch.phases for ev in ("load", "done")]


def test_single_sequence_forward_range_is_the_loop(engine):
    x, seqs = batch(engine, [(3, 4)])
    (kv, pos), = seqs
    kv2 = copy_seqs(seqs)[0][0]
    got = layers.forward_range(engine.arch, x, 0, 2, engine.load_phase, kv, pos)
    want = old_station_forward(engine.arch.ops, engine.cfg, x.copy(), 0, 2, engine.load_phase, [(kv2, pos)])
    np.testing.assert_array_equal(got, want)


def test_done_runs_for_a_failed_phase_and_the_range_is_checked(engine):
    w = SyncWeights(engine)
    broken = lambda layer, phase: {n: t for n, t in w.load(layer, phase).items() if "ffn_up" not in n}  # noqa: E731
    w2 = SyncWeights(engine)
    w2.load = broken
    x, seqs = batch(engine, [(0, 2)])
    with pytest.raises(MissingTensorError, match="phase ffn_up of layer 0: missing tensor blk.0.ffn_up.weight"):
        run_sync(layers.run_layers(engine.arch, x, 0, 2, seqs, w2))
    assert w2.log[-1] == ("done", 0, "ffn_up"), "the failed phase's weights were let go too"
    with pytest.raises(ValueError, match=r"layer range \[1, 3\) outside \[0, 2\)"):
        layers.steps(engine.arch, 1, 3)


def test_phase_loader_builds_each_phase_once_read_only_and_leaves_out_absent_tensors(engine):
    asked = []

    def get(name):
        asked.append(name)
        return None if name == "blk.1.ffn_up.weight" else engine.weight(name)

    load = layers.phase_loader(engine.arch, get)
    w = load(0, "attn")
    assert sorted(w) == sorted(engine.arch.phase_tensors(0, "attn"))
    assert all(w[n] is engine.weight(n) for n in w)
    n_asked = len(asked)
    assert load(0, "attn") is w and len(asked) == n_asked, "built once, then the same mapping"
    with pytest.raises(TypeError):
        w["blk.0.attn_q.weight"] = None  # read-only: a phase cannot change what the next forward reads
    assert "blk.1.ffn_up.weight" not in load(1, "ffn_up")
    x, seqs = batch(engine, [(0, 2)])
    with pytest.raises(MissingTensorError, match="phase ffn_up of layer 1: missing tensor blk.1.ffn_up.weight"):
        layers.forward_range(engine.arch, x, 0, 2, load, seqs[0][0], seqs[0][1])
    # the single process's own loader gives the loop the same bits as fresh mappings per phase
    fresh = lambda layer, phase: {n: engine.weight(n) for n in engine.arch.phase_tensors(layer, phase)}  # noqa: E731
    x, seqs = batch(engine, [(3, 4)])
    (kv, pos), = seqs
    kv2 = copy_seqs(seqs)[0][0]
    np.testing.assert_array_equal(layers.forward_range(engine.arch, x, 0, 2, engine.load_phase, kv, pos),
                                  layers.forward_range(engine.arch, x.copy(), 0, 2, fresh, kv2, pos))


def test_run_sync_refuses_code_that_needs_an_event_loop(engine):
    x, seqs = batch(engine, [(0, 1)])
    w = AsyncWeights(engine)
    with pytest.raises(WouldSuspend, match="run_layers"):
        run_sync(layers.run_layers(engine.arch, x, 0, 1, seqs, w))
    assert w.log == [], "it stopped at the first await that suspended, inside the first load"
    cleaned = []

    async def items():
        try:
            yield 1
            await asyncio.sleep(0)
            yield 2
        finally:
            cleaned.append(True)

    got = []
    with pytest.raises(WouldSuspend):
        for item in iterate_sync(items()):
            got.append(item)
    assert got == [1] and cleaned == [True], "the generator's own cleanup ran"


async def test_every_runner_runs_its_phases_through_the_loop(tiny_knot, tmp_path, engine, monkeypatch):
    """The single process and the stations of the in-process cluster: each phase that runs is
    called from common.layers.run_layers, and nowhere else."""
    callers: list[str] = []
    real = Qwen2.run_phase

    def spy(self, layer, phase, state, w, seqs):
        callers.append(sys._getframe(1).f_code.co_qualname)
        return real(self, layer, phase, state, w, seqs)

    monkeypatch.setattr(Qwen2, "run_phase", spy)
    n_phases = engine.cfg.n_layer * len(engine.arch.phases)
    engine.generate(engine.tokenizer.encode("the def"), max_tokens=3)
    assert len(callers) >= n_phases * 3 and set(callers) == {"run_layers"}
    callers.clear()
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    r = await c.generate(prompt="the def", max_tokens=3)
    assert r.status == 200, r.body
    assert len(callers) >= n_phases * 3 and set(callers) == {"run_layers"}
    await c.drain()


def test_the_registry_builds_the_loops_model(engine):
    assert isinstance(engine.arch, Qwen2) and engine.arch.cfg == model_for(engine.model.header).cfg
