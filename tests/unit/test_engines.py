"""One generation loop (common/generation.py) over the Engine protocol: the single process and the
cluster implement it and give identical Generation records; the finish reasons are OpenAI's."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import numpy as np
import pytest

from common.generation import Engine, FinishEvent, Generation, TokenEvent, generate_events
from common.runtime import Context, ServiceUnavailable
from common.sampling import SamplingParams
from common.speculative import Draft, SpeculationParams
from common.sync import iterate_sync
from deploy.engine_local import LocalEngine
from deploy.local.tasks import BackgroundTasks
from services.coordinator import handler as coordinator
from services.coordinator.cluster_engine import ClusterEngine
from services.coordinator.params import GenerateRequest
from tests.inprocess import build_cluster

PROMPT = "the def the"


@pytest.fixture(scope="module")
def engine(tiny_knot):
    return LocalEngine.open(tiny_knot)


def record(gen: Generation) -> dict:
    """A generation's compared fields as a Generation has them (a ClusterGeneration is a subclass)."""
    return {f.name: getattr(gen, f.name) for f in dataclasses.fields(Generation) if f.compare}


def local_run(engine, gen: Generation) -> list:
    return list(iterate_sync(generate_events(engine, gen, engine.tokenizer, time.perf_counter)))


CASES = [
    dict(max_tokens=10),
    dict(max_tokens=12, sampling=SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)),
    dict(max_tokens=6, logprobs=3),
]


async def test_both_engines_implement_the_protocol(engine, tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    co = await coordinator.coordinator_for(c.coordinator.env)
    assert isinstance(engine, Engine) and isinstance(co.engine, Engine) and isinstance(co.engine, ClusterEngine)
    await c.drain()


@pytest.mark.parametrize("case", range(len(CASES)))
async def test_local_engine_and_cluster_give_identical_generations(engine, tiny_knot, tmp_path, case):
    kw = CASES[case]
    ids = engine.tokenizer.encode(PROMPT)
    c = await build_cluster(tiny_knot, tmp_path, 2, 3)
    co = await coordinator.coordinator_for(c.coordinator.env)
    cluster = co.prepare(GenerateRequest(None, None, kw["max_tokens"], kw.get("sampling", SamplingParams()), (),
                                         tuple(ids), kw.get("logprobs")))
    tasks = BackgroundTasks("test")
    cluster_events = [ev async for ev in co.events(cluster, Context(tasks.add))]
    local = Generation(ids, kw["max_tokens"], kw.get("sampling", SamplingParams()), (), kw.get("logprobs"),
                       request_id="local")
    local_events = local_run(engine, local)
    assert record(local) == record(cluster)  # the cluster's record adds only its hops' fields
    assert local.token_ids and local.finish_reason in ("stop", "length")
    assert [(e.id, e.text) for e in local_events if isinstance(e, TokenEvent)] == \
           [(e.id, e.text) for e in cluster_events if isinstance(e, TokenEvent)]
    assert local_events[-1] == cluster_events[-1] == FinishEvent(local.finish_reason, local_events[-1].text)
    if kw.get("logprobs"):
        for a, b in zip(local_events[:-1], cluster_events[:-1]):
            assert [t for t, _ in a.logprobs.top] == [t for t, _ in b.logprobs.top]
            np.testing.assert_allclose([a.logprobs.logprob, *(lp for _, lp in a.logprobs.top)],
                                       [b.logprobs.logprob, *(lp for _, lp in b.logprobs.top)], rtol=1e-5)
    # and LocalEngine.generate is this same loop
    assert engine.generate(ids, kw.get("sampling", SamplingParams()), max_tokens=kw["max_tokens"]).token_ids == \
        local.token_ids
    await tasks.drain()
    await c.drain()


class Scripted:
    """An Engine whose logits make the greedy sampler pick the scripted ids, one per call."""

    def __init__(self, vocab: int, script: list[int]):
        self.vocab, self.script, self.calls = vocab, list(script), []

    def _next(self) -> np.ndarray:
        logits = np.zeros(self.vocab, np.float32)
        logits[self.script.pop(0)] = 10.0
        return logits

    async def prompt_logits(self, gen, ids):
        self.calls.append(("prompt", len(ids)))
        return self._next()

    async def next_logits(self, gen, token, history):
        self.calls.append(("next", token, len(history) - 1))
        return self._next()


def test_finish_reasons_are_stop_and_length(engine):
    tok = engine.tokenizer
    eog = min(tok.eog_ids)
    a, b, c = tok.encode("the def")[:3]  # "t", "he", " "
    vocab = engine.cfg.vocab_size

    def run(script, max_tokens, stop=()):
        gen = Generation([1, 2, 3], max_tokens, stop=stop)
        e = Scripted(vocab, script)
        events = list(iterate_sync(generate_events(e, gen, tok, iter(range(100)).__next__)))
        return gen, events, e.calls

    gen, events, calls = run([a, b, eog], 10)
    assert (gen.token_ids, gen.finish_reason, events[-1].reason) == ([a, b], "stop", "stop"), "end of generation"
    assert calls == [("prompt", 3), ("next", a, 3), ("next", b, 4)] and gen.decode_steps == 2
    gen, _, calls = run([a, b, a], 2)
    assert (gen.token_ids, gen.finish_reason) == ([a, b], "length") and calls[-1] == ("next", a, 3)
    gen, events, _ = run([a, b, c, a], 4, stop=("e ",))
    assert (gen.text, gen.token_ids, gen.finish_reason) == ("th", [a, b, c], "stop"), "a stop string"
    assert "".join(e.text for e in events) == "th", "the stop string is never shown"
    gen, events, calls = run([], 0)
    assert (gen.token_ids, gen.finish_reason, calls) == ([], "length", []), "nothing to sample: no prefill"


class PrimingDrafter:
    """A drafter with a prime() of its own pace (a drafter service reading the prompt), logging the order."""

    def __init__(self, log: list, fail: bool = False):
        self.log, self.fail = log, fail
        self.release = asyncio.Event()

    def prime(self, gen, prompt):
        return asyncio.ensure_future(self._prime(prompt))

    async def _prime(self, prompt):
        self.log.append(("prime starts", len(prompt)))
        await self.release.wait()
        if self.fail:
            raise ServiceUnavailable("drafter is down")
        self.log.append("primed")

    def propose(self, gen, context, k):
        self.log.append(("propose", len(context)))
        return Draft([])


async def test_a_draft_model_reads_the_prompt_beside_the_target_and_the_first_trip_waits_for_it(engine):
    tok = engine.tokenizer
    a, b = tok.encode("the def")[:2]
    eog = min(tok.eog_ids)
    spec = SpeculationParams("draft_model", 4)

    async def run(drafter, script, max_tokens=None):
        gen = Generation([1, 2, 3], max_tokens or len(script), speculation=spec)
        e = Scripted(engine.cfg.vocab_size, script)
        prompt_logits = e.prompt_logits

        async def slow_prompt(g, ids):  # the stations take a while; the prime runs meanwhile
            for _ in range(3):
                await asyncio.sleep(0)
            drafter.log.append("prompt done")
            drafter.release.set()
            return await prompt_logits(g, ids)

        e.prompt_logits = slow_prompt
        return gen, [ev async for ev in generate_events(e, gen, tok, time.perf_counter, drafter)]

    d = PrimingDrafter([])
    gen, _ = await run(d, [a, b, a])
    assert d.log[:4] == [("prime starts", 3), "prompt done", "primed", ("propose", 4)], d.log
    assert gen.token_ids == [a, b, a]
    d = PrimingDrafter([], fail=True)
    with pytest.raises(ServiceUnavailable, match="drafter is down"):
        await run(d, [a, b])
    assert ("propose", 4) not in d.log, "a failed prime fails the request before any proposal"
    d = PrimingDrafter([])
    d.release.set = lambda: None  # the prime never finishes: the generation ends first and cancels it
    gen, _ = await run(d, [eog], max_tokens=4)
    assert gen.finish_reason == "stop" and d.log == [("prime starts", 3), "prompt done"]
    gen, _ = await run(PrimingDrafter([]), [a], max_tokens=1)
    assert gen.token_ids == [a], "one token needs no trip, so no prime"


def test_cli_json_reports_openai_finish_reasons(tiny_gguf, capsys):
    from deploy.cli import main

    assert main(["generate", str(tiny_gguf), PROMPT, "--max-tokens", "6", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["finish_reason"] == "length" and len(full["token_ids"]) == 6
    stop = full["text"][1:3]
    assert main(["generate", str(tiny_gguf), PROMPT, "--max-tokens", "6", "--json", "--stop", stop]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["finish_reason"] == "stop" and cut["text"] == full["text"][:full["text"].index(stop)]
