"""The Inspector over HTTP (a server of its own, with --api-key): the page loads without
the key and /inspect/state needs it; the query is validated; --disable-inspector removes
both routes. Then a real headless Chromium opens the page while requests run and checks
that the tree, the batch and the pool appear and change (screenshots saved), and renders
a synthetic 10,000-node snapshot against a time bound.

Screenshots go to $LMPROG_SCREENSHOT_DIR when set (docs/img/ was made that way), else
to the test's temporary folder.
"""

import asyncio
import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import requests

from cdp import Browser, find_chromium
from server_harness import LiveServer

KEY = "sk-inspector"
AUTH = {"Authorization": f"Bearer {KEY}"}
RENDER_BOUND_MS = 5000  # generous: a 10,000-node render takes far less on an idle machine


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    # 3 running at most: a batch of 4 leaves one waiting, so the queue table has rows too
    srv = LiveServer(tiny_model_path, tmp_path_factory.mktemp("inspector"),
                     ["--api-key", KEY, "--max-running-requests", "3"]).start()
    yield srv
    srv.stop(signal.SIGTERM)


def test_page_is_open_and_state_needs_the_key(server):
    page = requests.get(server.url + "/inspect", timeout=30)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert '<script src="/inspect/inspect.js">' in page.text and "http" not in page.text.split("<body>")[1]
    for path in ("/inspect/tree.js", "/inspect/inspect.js", "/inspect/inspect.css"):
        assert requests.get(server.url + path, timeout=30).status_code == 200
    assert requests.get(server.url + "/inspect/state", timeout=30).status_code == 401
    requests.post(server.url + "/generate", headers=AUTH, timeout=60,
                  json={"text": "Inspector over HTTP", "sampling_params": {"max_new_tokens": 4}}).raise_for_status()
    snap = requests.get(server.url + "/inspect/state", headers=AUTH, timeout=30).json()
    assert snap["tree"]["num_nodes"] >= 1 and snap["pool"]["total"] > 0
    assert {"running", "waiting", "steps", "grammars", "handoffs", "counters"} <= set(snap)
    lean = requests.get(server.url + "/inspect/state?tree=0", headers=AUTH, timeout=30).json()
    assert lean["tree"] is None and lean["tree_s"] is None and lean["pool"] == snap["pool"]


@pytest.mark.parametrize("query, field", [("max_nodes=0", "max_nodes"), ("max_nodes=20001", "max_nodes"),
                                          ("max_nodes=abc", "max_nodes"), ("tree=yes", "tree"),
                                          ("nodes=5", "nodes")])
def test_bad_query_is_400_naming_the_field(server, query, field):
    r = requests.get(server.url + "/inspect/state?" + query, headers=AUTH, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: expected")


def test_disable_inspector_removes_the_routes():
    from lmprog_runtime.config import ServerArgs
    from lmprog_runtime.server.http import create_app

    def paths(**kw):
        runtime = SimpleNamespace(args=ServerArgs(**kw))
        return {r.resource.canonical for r in create_app(runtime).router.routes()}

    assert {"/inspect", "/inspect/state"} <= paths()
    assert not any(p.startswith("/inspect") for p in paths(disable_inspector=True))


def test_disable_inspector_flag():
    import argparse

    from lmprog_runtime.config import FLAG_HELP, add_cli_args, from_cli_namespace

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert from_cli_namespace(parser.parse_args(["--disable-inspector"])).disable_inspector is True
    assert from_cli_namespace(parser.parse_args([])).disable_inspector is False
    assert "Inspector" in FLAG_HELP["disable_inspector"]


# -- the browser ----------------------------------------------------------------------------
needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason="no chromium on PATH (apt-get install -y chromium)")


def _shots_dir(tmp_path) -> str:
    return os.environ.get("LMPROG_SCREENSHOT_DIR") or str(tmp_path)


def _load(server, stop: threading.Event) -> None:
    """Requests with shared prefixes and long outputs until `stop`: the batch stays busy."""
    i = 0
    while not stop.is_set():
        regex = {"text": "Answer yes or no:", "sampling_params": {"max_new_tokens": 8, "regex": "(yes|no)[.!]"}}
        requests.post(server.url + "/generate", json=regex, headers=AUTH, timeout=120)
        texts = [f"System: you are helpful. User {i % 3} asks question {i}-{j} about radix trees"
                 for j in range(4)]
        body = {"text": texts, "sampling_params": {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}}
        requests.post(server.url + "/generate", json=body, headers=AUTH, timeout=120)
        i += 1


async def _open_with_key(b: Browser, url: str) -> None:
    await b.goto(url + "/inspect")
    await b.eval(f"sessionStorage.setItem('lmprog-inspect-key', {json.dumps(KEY)})")
    await b.goto(url + "/inspect", ready="window.inspector && window.inspector.state.polls > 0")


async def _watch_live(b: Browser, server, shots: str) -> dict:
    await _open_with_key(b, server.url)
    first = await b.eval("({tree: inspector.tree.count, polls: inspector.state.polls})")
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(server, stop), daemon=True)
    load.start()
    try:
        await b.wait_for("inspector.state.seen.maxBatchRows >= 2 && inspector.state.seen.maxQueueRows >= 1",
                         timeout=120)
        await b.screenshot(os.path.join(shots, "inspector-live.png"))
        await b.wait_for("new Set(inspector.state.seen.treeCounts).size >= 3", timeout=120)
    finally:
        stop.set()
        load.join(150)
    await b.wait_for("inspector.state.snap && inspector.state.snap.running.length === 0", timeout=60)
    await b.eval("new Promise(r => setTimeout(r, 1500))")  # a tree refresh after the load ended
    await b.screenshot(os.path.join(shots, "inspector-idle.png"))
    return {"first": first, **await b.eval("""({
        tree: inspector.tree.count, drawn: inspector.tree.drawn,
        seen: inspector.state.seen, errors: inspector.state.errors,
        poolSegments: document.querySelectorAll('#pool-bar div').length,
        grammarRows: document.querySelectorAll('#grammars tbody tr').length,
        steps: inspector.state.snap.steps.length,
        summary: document.getElementById('tree-summary').textContent})""")}


@needs_chromium
def test_browser_shows_the_live_state(server, tmp_path):
    async def run():
        async with Browser() as b:
            return await _watch_live(b, server, _shots_dir(tmp_path)), b.console

    got, console = asyncio.run(run())
    assert not [c for c in console if c.startswith("EXCEPTION")], console
    seen = got["seen"]
    assert got["errors"] == 0
    assert seen["maxBatchRows"] >= 2  # the batch table showed the running requests
    assert seen["maxQueueRows"] >= 1  # and the one waiting for a row
    assert got["grammarRows"] >= 1  # the regex's compiled grammar
    assert got["tree"] > got["first"]["tree"] and got["drawn"] > 0  # the tree grew on the canvas
    assert len(set(seen["poolUsed"])) >= 3 and got["poolSegments"] == 5  # the pool moved
    assert got["steps"] > 0 and "nodes" in got["summary"]


def _synthetic_snapshot(server, num_nodes: int) -> dict:
    from inspect_helpers import decode, tree_of_at_least

    from lmprog_runtime.cache.tree_view import tree_view

    snap = requests.get(server.url + "/inspect/state?tree=0", headers=AUTH, timeout=30).json()
    _, tree, _ = tree_of_at_least(num_nodes)
    t0 = time.perf_counter()
    snap["tree"] = tree_view(tree, decode, max_nodes=num_nodes)
    snap["tree_s"] = time.perf_counter() - t0
    assert snap["tree"]["shown"] == num_nodes
    return snap


async def _node_on_screen(b: Browser) -> dict:
    """Page coordinates of a drawn node with children (the first such in the snapshot)."""
    return await b.eval("""(() => {
        const v = inspector.tree, r = v.canvas.getBoundingClientRect();
        const n = v.nodes.find(n => n.kids.length && n.shownNow && n.y * v.ky + v.y > 10
                               && n.y * v.ky + v.y < r.height - 10 && n.x * v.kx + v.x < r.width - 10);
        return n && {id: n.id, x: r.left + n.x * v.kx + v.x, y: r.top + n.y * v.ky + v.y};
    })()""")


@needs_chromium
def test_browser_node_detail_collapse_and_download(server, tmp_path):
    requests.post(server.url + "/generate", headers=AUTH, timeout=60, json={
        "text": ["Shared start, then branch one", "Shared start, then branch two"],
        "sampling_params": {"max_new_tokens": 4}}).raise_for_status()

    async def run():
        async with Browser() as b:
            await _open_with_key(b, server.url)
            await b.wait_for("inspector.tree.count >= 2")
            await b.eval("inspector.stop()")
            node = await _node_on_screen(b)
            await b.click(node["x"], node["y"])
            detail = await b.wait_for("document.getElementById('node-detail').innerText")
            await b.click(node["x"], node["y"], count=2)
            collapsed = await b.eval("[...inspector.tree.collapsed]")
            await b.allow_downloads(str(tmp_path))
            await b.eval("document.getElementById('download').click(), true")
            for _ in range(100):
                files = [f for f in os.listdir(tmp_path) if f.startswith("lmprog-inspect-") and f.endswith(".json")]
                if files:
                    break
                await asyncio.sleep(0.1)
            return node, detail, collapsed, files

    node, detail, collapsed, files = asyncio.run(run())
    assert f"id\t{node['id']}" in detail and "subtree tokens" in detail and "lock_ref" in detail
    assert collapsed == [node["id"]]
    assert len(files) == 1
    with open(os.path.join(tmp_path, files[0])) as f:
        saved = json.load(f)
    assert saved["snapshot"]["tree"]["num_nodes"] >= 2 and saved["pool_history"]
    assert {"running", "pool", "steps", "grammars"} <= set(saved["snapshot"])


@needs_chromium
def test_browser_renders_10000_nodes(server, tmp_path):
    snap = _synthetic_snapshot(server, 10_000)

    async def run():
        async with Browser() as b:
            await _open_with_key(b, server.url)
            await b.eval("inspector.stop()")
            await b.eval(f"window.__synthetic = {json.dumps(snap)}; true")
            out = await b.eval("""(() => {
                const ms = [inspector.render(__synthetic), inspector.render(__synthetic)];
                const t0 = performance.now(); TreeView.draw(inspector.tree); const redraw = performance.now() - t0;
                return {ms, redraw, count: inspector.tree.count, drawn: inspector.tree.drawn,
                        layout: inspector.tree.layoutMs};
            })()""")
            await b.screenshot(os.path.join(_shots_dir(tmp_path), "inspector-10k.png"))
            out["zoomed_drawn"] = await b.eval(
                "(() => { const v = inspector.tree; v.kx = 0.9; v.ky = 0.9; v.y = 20 - v.byId.get(v.nodes[0].id).y * 0.9;"
                " TreeView.draw(v); return v.drawn; })()")
            await b.screenshot(os.path.join(_shots_dir(tmp_path), "inspector-10k-zoomed.png"))
            return out

    out = asyncio.run(run())
    print(f"\n10,000-node snapshot: render {out['ms']} ms, redraw {out['redraw']:.1f} ms, "
          f"layout {out['layout']:.1f} ms, {out['drawn']} nodes in view, tree_view {snap['tree_s'] * 1000:.0f} ms")
    assert out["count"] == 10_000 and out["drawn"] > 1000 and 0 < out["zoomed_drawn"] < out["drawn"]
    assert max(out["ms"]) < RENDER_BOUND_MS and out["redraw"] < RENDER_BOUND_MS
