"""Issue 53 in a real browser: the coordinator's page (GET /) against a real cluster of processes.
It loads and draws every service; the playground streams the API's greedy answer; a killed shard
shows restarting, then red (down) past PEER_WAIT_S, and ready again after its restart; a request's
waterfall lists its hops in order. Screenshots of the page go to docs/images/ (docs/operations.md
shows them)."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.integration.conftest import http

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
PROMPT = "the def the"
NODES = ["coordinator", "station 0", "station 1", *(f"shard {i}" for i in range(8)), "layer warden",
         "cobordism warden", "bucket"]


def node(page, name):
    return page.locator(f'#topology g[data-node="{name}"]')


def test_the_page_shows_the_cluster_and_a_streamed_answer_with_its_waterfall(cluster, page):  # noqa: F811
    page.goto(cluster.url("coordinator") + "/")
    for name in NODES:
        node(page, name).wait_for()
    healths = {n: node(page, n).get_attribute("data-health") for n in NODES}
    assert all(healths[n] == "ready" for n in NODES), healths
    assert "layers 0–" in node(page, "station 0").text_content()
    assert "vocab 0–" in node(page, "shard 0").text_content()

    # the playground: greedy, so the streamed answer must be the API's
    page.fill("#prompt", PROMPT)
    page.fill("#max-tokens", "10")
    page.fill("#temperature", "0")
    page.click("#run")
    page.wait_for_selector('#answer-meta[data-done="1"]')
    status, _, raw = http("POST", cluster.url("coordinator") + "/v1/completions",
                          {"model": "pipeline", "prompt": PROMPT, "max_tokens": 10, "temperature": 0})
    assert status == 200, raw
    want = json.loads(raw)["choices"][0]["text"]
    assert want and page.locator("#answer").text_content() == want

    # its trace opens as a waterfall: the prompt's embedding, station 0, station 1, the LM head
    page.wait_for_selector("#waterfall g.span")
    spans = page.locator("#waterfall g.span").evaluate_all(
        "gs => gs.map(g => [g.dataset.name, g.dataset.peer])")
    assert spans[0] == ["POST /v1/completions", "coordinator"], spans[:3]
    hops = [s for s in spans if s[1] in ("STATION_0", "STATION_1") or s[0] in ("/embed", "/logits", "/sample")]
    assert hops[0][0] == "/embed", hops[:6]
    first_forward = hops.index(["/forward", "STATION_0"])
    assert hops[first_forward + 1] == ["/forward", "STATION_1"], hops[:8]
    assert hops[first_forward + 2][0] in ("/logits", "/sample"), hops[:8]

    # longer requests, one after another until a poll of the page has seen one in flight with its progress
    seen = threading.Event()

    def generate_until_seen() -> list[int]:
        statuses = []
        while not seen.is_set() and len(statuses) < 40:
            statuses.append(http("POST", cluster.url("coordinator") + "/generate",
                                 {"prompt": PROMPT, "max_tokens": 150, "temperature": 0}, timeout_s=120)[0])
        return statuses

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate_until_seen)
        try:
            row = page.locator("#in-flight tr", has_text="/150")
            row.wait_for(timeout=60_000)
            assert row.locator("progress").get_attribute("max") == "150"
            IMAGES.mkdir(exist_ok=True)
            page.screenshot(path=str(IMAGES / "cluster-page.png"), full_page=True)
        finally:
            seen.set()
        assert set(running.result()) == {200}


def test_a_killed_shard_shows_restarting_then_red_and_back_after_its_restart(cluster, page):  # noqa: F811
    page.goto(cluster.url("coordinator") + "/")
    node(page, "shard 3").wait_for()
    page.wait_for_selector('#topology g[data-node="shard 3"][data-health="ready"]')
    cluster.stop("shard-3")
    try:  # restarting for PEER_WAIT_S (15 s here), then down (red) until it is started again
        page.wait_for_selector('#topology g[data-node="shard 3"][data-health="restarting"]', timeout=10_000)
        assert node(page, "shard 3").locator("rect").get_attribute("fill") == "#7b1fa2"
        assert "no answer for" in node(page, "shard 3").text_content()
        assert node(page, "shard 2").get_attribute("data-health") == "ready"
        page.screenshot(path=str(IMAGES / "cluster-page-shard-restarting.png"))
        page.wait_for_selector('#topology g[data-node="shard 3"][data-health="down"]', timeout=30_000)
        assert node(page, "shard 3").locator("rect").get_attribute("fill") == "#c62828"
    finally:
        cluster.start("shard-3")
    page.wait_for_selector('#topology g[data-node="shard 3"][data-health="ready"]', timeout=30_000)


def test_with_an_api_key_the_page_asks_for_it_and_keeps_it_in_the_tab(cluster, page):  # noqa: F811
    key = "page-test-key-" + "k" * 32
    env = cluster.specs["coordinator"].environment
    saved = dict(env)
    env["KNOT_API_KEY"] = key
    env["KNOT_VARS"] = ",".join([v for v in env.get("KNOT_VARS", "").split(",") if v] + ["KNOT_API_KEY"])
    cluster.restart("coordinator")
    try:
        page.goto(cluster.url("coordinator") + "/")
        page.wait_for_selector("#login-form", state="visible")
        assert page.locator("#topology g").count() == 0  # nothing shown without the key
        page.fill("#key", "wrong")
        page.click("#login-form button")
        page.wait_for_selector("#login-error:has-text('refused')")
        page.fill("#key", key)
        page.click("#login-form button")
        node(page, "shard 7").wait_for()
        assert page.evaluate("sessionStorage.getItem('knot_api_key')") == key
        assert page.evaluate("document.cookie") == ""  # the key is in the tab only, never a cookie
    finally:
        env.clear()
        env.update(saved)
        cluster.restart("coordinator")
