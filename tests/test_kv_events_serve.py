"""`prefixlab serve --kv-events` publishing, `prefixlab watch` subscribing: no mock on either side."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import openai

from app.serve.cli import model_loader
from app.serve.kv_events_publisher import KVEventPublisher
from app.watch.subscriber import Watcher
from engine import prefix_held_groups
from engine.scheduler import SchedulerSettings
from tests.serve_helpers import start_server, wait_idle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = ("You are the assistant of Bolt & Board, a neighbourhood hardware store. We sell power drills, "
          "hand saws, screws, nails, paint and ladders. Answer in one short sentence.")
QUESTIONS = ["Do you sell drills?", "Do you have green paint?", "Can I buy a ladder here?",
             "Are nails sold by weight?"]


class Watch:
    """`prefixlab watch` in a child process; its lines are read as they come."""

    def __init__(self, pub: KVEventPublisher, out):
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "watch", "--kv-events", pub.endpoint, "--kv-events-replay",
             pub.replay_endpoint, "--json", str(out)],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, text=True)
        self.guard = threading.Timer(120, self.proc.kill)  # a stuck child must not hang the suite
        self.guard.start()

    def until_seq(self, seq: int) -> None:
        """Read its lines until it printed the batch `seq`."""
        for line in self.proc.stdout:
            m = re.match(r"engine 0 seq (\d+):", line)
            if m and int(m.group(1)) >= seq:
                return
        raise AssertionError("prefixlab watch ended before the last batch")

    def stop(self) -> dict:
        """SIGTERM (as a service manager stops it): it writes the JSON and exits 0."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.stdout.read()
        assert self.proc.wait(30) == 0
        self.guard.cancel()
        (engine,) = json.loads(self.out.read_text())["engines"]
        return engine


def test_serve_publishes_and_prefixlab_watch_rebuilds_the_cache(real_model, tmp_path):
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    # serve's own loader and hook, as `prefixlab serve --kv-events` wires them (the model
    # loads again from the weight image real_model wrote: memory-mapped, quick)
    settings = SchedulerSettings(max_streams=4, page_rows=16)
    server = start_server(model_loader(real_model.path, settings), prepare=lambda s: pub.attach(s.cache))
    try:
        watch = Watch(pub, tmp_path / "during.json")
        assert pub.wait_for_subscriber(30)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        threads = [threading.Thread(target=client.chat.completions.create, kwargs=dict(
            model="any", max_tokens=6, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]))
            for q in QUESTIONS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wait_idle(server)
        assert pub.flush(10)
        watch.until_seq(pub.published_batches - 1)
        seen = watch.stop()
        cache = server.engine.scheduler.cache  # the engine thread is idle
        assert {b["hash"] for b in seen["blocks"]} == set(cache.pages)
        assert seen["live_blocks"] == prefix_held_groups(cache) > 0
        parents = {k: e.parent for k, e in cache.pages.items()}
        assert {b["hash"]: b["parent"] for b in seen["blocks"]} == parents
        # the four prompts share the system prompt's first pages: one tree holds every request
        assert seen["chains"][0]["blocks"] == len(cache.pages) and seen["chains"][0]["leaves"] >= 4
        assert (seen["seq_gaps"], seen["bad_frames"]) == (0, 0)
    finally:
        server.stop()  # joins the engine thread: the scheduler is this thread's now
    scheduler = server.engine.scheduler
    subscribed = pub.subscriptions
    late = Watch(pub, tmp_path / "after.json")   # joins late: replay brings back the history
    for _ in range(3000):
        if pub.subscriptions > subscribed:
            break
        threading.Event().wait(0.01)
    assert pub.subscriptions > subscribed, "the second watcher never subscribed"
    assert scheduler.flush_cache() > 0
    assert pub.flush(10)
    late.until_seq(pub.published_batches - 1)
    after = late.stop()
    pub.close()
    assert after["live_blocks"] == 0 == prefix_held_groups(scheduler.cache)
    assert after["stored_blocks"] == after["removed_blocks"] == seen["stored_blocks"]


def test_the_serve_command_publishes_its_cache_as_kv_events():
    env = {**os.environ, "PYTHONPATH": ROOT, "OPENBLAS_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", "0", "--max-streams", "2",
           "--kv-events", "127.0.0.1:0", "--kv-events-replay", "127.0.0.1:0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    guard = threading.Timer(180, proc.kill)
    guard.start()
    watcher = None
    try:
        lines = iter(proc.stdout.readline, "")
        url = re.search(r"listening on (http://\S+)/v1", next(lines)).group(1)
        kv = re.search(r"KV events on (tcp://\S+), replay on (tcp://\S+) ", next(lines))
        watcher = Watcher([kv.group(1)], [kv.group(2)])
        assert any("ready" in line for line in lines)
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        client.chat.completions.create(model="m", max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}])
        state = watcher.states[0]
        cached = 0
        for _ in range(200):  # until the feed and the server's metrics agree (both settle at once)
            watcher.poll(50)
            metrics = httpx.get(url + "/metrics").text
            cached = int(re.search(r'pool_pages\{state="cached"\} (\d+)', metrics).group(1))
            if cached and state.live == cached:
                break
        assert state.live == cached > 0 and state.counters.bad_frames == 0
    finally:
        if watcher is not None:
            watcher.close()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        guard.cancel()
    assert proc.returncode == 0, out


def test_the_apps_server_toggle_publishes_the_desktop_engines_cache(qtbot, tiny_gguf_path):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from app.desktop.desktop_engine import ModelLoaded
    from app.desktop.engine_driver import EngineDriver
    from app.desktop.settings import AppSettings
    from app.serve.desktop import DesktopServer

    assert "Server KV events: not a ZeroMQ endpoint" in AppSettings(server_kv_events="nope").errors()[0]
    driver, reports = EngineDriver(), []
    driver.reported.connect(reports.append)
    server, watcher = DesktopServer(driver), None
    try:
        driver.apply_settings(AppSettings(page_rows=4, max_streams=4))
        driver.load_model(tiny_gguf_path)
        qtbot.waitUntil(lambda: any(isinstance(r, ModelLoaded) for r in reports), timeout=60_000)
        url = server.start(port=0, kv_events="127.0.0.1:0")
        watcher = Watcher([server.publisher.endpoint])
        assert server.publisher.wait_for_subscriber(10)
        body = {"model": "m", "max_tokens": 3, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paint?"}]}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        cache = driver.engine.scheduler.cache
        state = watcher.states[0]
        qtbot.waitUntil(lambda: watcher.poll(20) is not None and 0 < state.live == len(cache.pages),
                        timeout=20_000)
        assert state.block_hashes() == set(cache.pages)
    finally:
        server.stop()
        if watcher is not None:
            watcher.close()
        driver.shutdown()
    assert server.publisher is None and cache.listeners == []
