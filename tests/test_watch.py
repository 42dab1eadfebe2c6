"""`prefixlab watch`: the rebuilt cache state, the CLI's JSON, Ctrl+C / SIGTERM, llama.cpp parsing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from app.cli import main as cli_main
from app.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from app.serve.kv_events_publisher import KVEventPublisher
from app.watch.llama_server import LlamaServerPoller, parse_metrics, parse_slots
from app.watch.state import EngineState, cross_engine
from tests.kv_events_helpers import Event, Page
from tests.wait import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _apply(state: EngineState, seq: int, *events) -> None:
    state.apply(seq, KVEventBatch(float(seq), list(events)))


def test_state_counts_a_block_stored_twice_once_and_keeps_parent_links():
    s = EngineState(0, "tcp://x")
    _apply(s, 0, BlockStored([1, 2, 3], None, [1, 1, 2, 2, 3, 3], 2, medium="GPU"))
    _apply(s, 1, BlockStored([2], 1, [2, 2], 2, medium="GPU"), BlockStored([4], 2, [4, 4], 2, medium="GPU"))
    assert s.live == 4 and s.counters.stored_blocks == 4 and s.counters.duplicate_stores == 1
    blocks = s.tiers[("GPU", None)]
    assert [blocks[h].parent for h in (1, 2, 3, 4)] == [None, 1, 2, 2]
    (chain,) = s.chains()
    assert (chain["root"], chain["blocks"], chain["leaves"], chain["depth"]) == (1, 4, 2, 3)
    _apply(s, 2, BlockRemoved([2, 99], medium="GPU"))  # a parent goes first; 99 was never stored
    assert s.counters.unknown_removes == 1 and s.live == 3
    assert sorted((c["root"], c["orphan"]) for c in s.chains()) == [(1, False), (3, True), (4, True)]
    _apply(s, 3, AllBlocksCleared())
    assert s.live == 0 and s.counters.cleared == 1 and s.chains() == []


def test_state_keeps_tiers_apart_and_caps_blocks():
    s = EngineState(0, "tcp://x", max_blocks=3)
    _apply(s, 0, BlockStored([1], None, [7], 1, medium="GPU"), BlockStored([1], None, [7], 1, medium="CPU"))
    _apply(s, 1, BlockRemoved([1], medium="GPU"))  # offloaded: gone from GPU, still in CPU memory
    assert s.tiers[("CPU", None)].keys() == {1} and not s.tiers[("GPU", None)]
    _apply(s, 2, BlockStored([2, 3, 4, 5], 1, [1, 2, 3, 4], 1, medium="CPU"))
    assert s.live == 3 and s.counters.over_cap == 2
    assert s.summary()["max_blocks"] == 3


def test_cross_engine_finds_the_same_prefix_under_different_hash_seeds():
    a, b, c = EngineState(0, "a"), EngineState(1, "b"), EngineState(2, "c")
    _apply(a, 0, BlockStored([10, 11], None, [1, 2, 3, 4], 2))
    _apply(b, 0, BlockStored([90, 91, 92], None, [1, 2, 3, 4, 5, 6], 2))  # same two blocks, then more
    _apply(c, 0, BlockStored([10], None, [9, 9], 2))                       # same hash, other tokens
    dup = cross_engine([a, b, c])
    assert dup["shared_blocks"] == 2 and dup["by_engines"] == {"0,1": 2}
    assert dup["deepest"][0] == {"engines": [0, 1], "depth_blocks": 2}


def _publish_when_subscribed(pub: KVEventPublisher) -> threading.Thread:
    def go():
        assert pub.wait_for_subscriber(10)
        pub(Event("stored", (Page(1, None, (1, 2)), Page(2, 1, (3, 4)), Page(3, 2, (5, 6)))))
        pub(Event("removed", (Page(3, 2, (5, 6)),)))
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_cli_watch_writes_the_rebuilt_state_at_the_end_of_duration(tmp_path, capsys):
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    out = tmp_path / "watch.json"
    try:
        t = _publish_when_subscribed(pub)
        assert cli_main(["watch", "--kv-events", pub.endpoint, "--kv-events-replay", pub.replay_endpoint,
                         "--duration", "3", "--json", str(out)]) == 0
        t.join()
    finally:
        pub.close()
    (eng,) = json.loads(out.read_text())["engines"]
    assert (eng["live_blocks"], eng["stored_blocks"], eng["removed_blocks"]) == (2, 3, 1)
    assert {(b["hash"], b["parent"]) for b in eng["blocks"]} == {(1, None), (2, 1)}
    assert eng["chains"][0]["blocks"] == 2 and eng["bad_frames"] == 0 and eng["seq_gaps"] == 0
    printed = capsys.readouterr().out
    assert f"engine 0 = {pub.endpoint}" in printed and "+3 stored" in printed


def test_cli_watch_writes_the_json_on_sigterm(tmp_path):
    pub = KVEventPublisher("tcp://127.0.0.1:*")
    out = tmp_path / "watch.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "watch", "--kv-events", pub.endpoint,
                             "--json", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    guard = threading.Timer(60, proc.kill)  # a watcher that never prints must not hang the suite
    guard.start()
    try:
        t = _publish_when_subscribed(pub)
        lines = iter(proc.stdout.readline, "")
        assert any("live 2" in line for line in lines)   # the removal's batch arrived
        t.join()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        guard.cancel()
        proc.kill()
        pub.close()
    assert json.loads(out.read_text())["engines"][0]["live_blocks"] == 2


def test_data_parallel_ranks_are_watched_on_offset_ports():
    from app.watch.cli import rank_endpoints
    assert rank_endpoints(["tcp://h:5557", "tcp://g:6000"], 2) == ["tcp://h:5557", "tcp://h:5558",
                                                                   "tcp://g:6000", "tcp://g:6001"]


def test_cli_watch_refuses_bad_arguments_clearly(capsys):
    with pytest.raises(SystemExit, match="one of --kv-events"):
        cli_main(["watch"])
    with pytest.raises(SystemExit, match="2 replay endpoints for 1 event endpoints"):
        cli_main(["watch", "--kv-events", "tcp://127.0.0.1:1", "--kv-events-replay", "tcp://a:1", "tcp://b:2"])
    with pytest.raises(SystemExit, match="not a ZeroMQ endpoint: 'bogus'"):
        cli_main(["watch", "--kv-events", "tcp://127.0.0.1:1", "--kv-events-replay", "bogus"])
    with pytest.raises(SystemExit, match="needs tcp://HOST:PORT endpoints, got ipc:///tmp/kv"):
        cli_main(["watch", "--kv-events", "ipc:///tmp/kv", "--data-parallel-size", "2"])
    with pytest.raises(SystemExit, match="http"):
        cli_main(["watch", "--llama-server", "localhost:8080"])


# Shapes from llama.cpp's tools/server/README.md: the current one, and an older build's.
SLOTS_NOW = [
    {"id": 0, "id_task": 135, "n_ctx": 65536, "speculative": False, "is_processing": True,
     "params": {"n_predict": -1, "temperature": 0.8, "samplers": ["top_k"]},
     "next_token": {"has_next_token": True, "has_new_line": False, "n_remain": -1, "n_decoded": 0}},
    {"id": 1, "id_task": 0, "n_ctx": 65536, "speculative": False, "is_processing": False,
     "params": {}, "next_token": {"has_next_token": True, "n_remain": -1, "n_decoded": 136},
     "n_prompt_tokens": 812, "n_prompt_tokens_cache": 790},
]
SLOTS_OLD = [{"id": 0, "task_id": 3, "n_ctx": 2048, "state": 1, "prompt": "Say hello to llama.cpp",
              "next_token": [{"has_next_token": True, "n_remain": -1, "n_decoded": 7}]}]
METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1602
llamacpp:tokens_predicted_total 211
llamacpp:requests_processing 1
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 4
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2
"""


def test_llama_server_slots_and_metrics_parse_across_versions():
    now = parse_slots(SLOTS_NOW)
    assert [(s.id, s.processing, s.task, s.n_decoded) for s in now] == [(0, True, 135, 0), (1, False, 0, 136)]
    assert (now[1].n_prompt_tokens, now[1].n_prompt_tokens_cache, now[0].n_prompt_tokens) == (812, 790, None)
    (old,) = parse_slots(SLOTS_OLD)
    assert (old.processing, old.task, old.n_decoded, old.n_ctx) == (True, 3, 7, 2048)
    m = parse_metrics(METRICS)
    assert m["llamacpp:prompt_tokens_total"] == 1602 and m["llamacpp:requests_processing"] == 1
    assert m["llamacpp:spec_decode_num_accepted_tokens_per_pos_total"] == 6
    with pytest.raises(ValueError, match="expected a JSON array"):
        parse_slots({"error": {"code": 501, "message": "This server does not support slots endpoint."}})


@pytest.mark.skipif(shutil.which("llama-server") is None,
                    reason="no llama-server binary on PATH (llama.cpp's server); the parsing is tested "
                           "on the README's JSON shapes above")
def test_llama_server_live(tmp_path, real_model):
    import urllib.request

    port = 18000 + os.getpid() % 1000
    proc = subprocess.Popen(["llama-server", "-m", real_model.path, "--port", str(port), "--metrics",
                             "-c", "512"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: urllib.request.urlopen(url + "/health", timeout=1).read() is not None, 60,
                   "llama-server to start", interval=0.5, ignore=(OSError,))
        sample = LlamaServerPoller(url).poll()
        assert sample.slots and not sample.errors and "llamacpp:prompt_tokens_total" in sample.metrics
    finally:
        proc.terminate()
        proc.wait(10)


def test_watch_session_hands_the_ui_ready_snapshots():
    from app.watch.session import WatchSession
    pub = KVEventPublisher("tcp://127.0.0.1:*")
    session = WatchSession([pub.endpoint], snapshot_every=0.05).start()
    try:
        _publish_when_subscribed(pub).join()
        wait_until(lambda: session.latest and session.latest.engines[0].summary["removed_blocks"] == 1, 10,
                   "the removal in the UI's snapshot")
        (view,) = session.latest.engines
        assert view.summary["live_blocks"] == 2 and view.chains[0]["blocks"] == 2
        assert view.history[-1][1:] == (3, 1, 2)  # stored, removed, live after the last batch
        assert session.error is None
    finally:
        session.stop()
        pub.close()


def test_cli_watch_model_shows_chains_as_text(tmp_path, tiny_gguf_path, tiny_model):
    import engine
    toks = tuple(engine.encode(tiny_model, "hello there"))
    pub = KVEventPublisher("tcp://127.0.0.1:*")
    out = tmp_path / "watch.json"

    def go():
        assert pub.wait_for_subscriber(10)
        pub(Event("stored", (Page(5, None, toks),)))
    t = threading.Thread(target=go, daemon=True)
    t.start()
    try:
        assert cli_main(["watch", "--kv-events", pub.endpoint, "--model", tiny_gguf_path, "--quiet",
                         "--duration", "3", "--json", str(out)]) == 0
        t.join()
    finally:
        pub.close()
    (chain,) = json.loads(out.read_text())["engines"][0]["chains"]
    assert chain["preview"] == "hello there" and chain["first_tokens"] == list(toks)


def test_cli_watch_polls_a_server_with_llama_cpps_endpoints(tmp_path):
    import http.server

    hits = {"metrics": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/slots":
                body = json.dumps(SLOTS_NOW).encode()
            elif self.path == "/metrics" and hits["metrics"] < 2:
                hits["metrics"] += 1  # counters grow by 100 prompt tokens per poll
                body = METRICS.replace("1602", str(1602 + 100 * hits["metrics"])).encode()
            else:  # a server started without --metrics, as llama.cpp answers it
                self.send_error(501, "This server does not support metrics endpoint.")
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    out = tmp_path / "llama.json"
    try:
        poller = LlamaServerPoller(url)
        samples = [poller.poll() for _ in range(3)]
        assert cli_main(["watch", "--llama-server", url, "--duration", "0", "--json", str(out)]) == 0
    finally:
        server.shutdown()
    assert all(len(s.slots) == 2 and s.slots[1].n_prompt_tokens_cache == 790 for s in samples)
    assert samples[0].prompt_tokens_per_s is None and samples[1].prompt_tokens_per_s > 0
    assert "start llama-server with --metrics" in samples[2].errors[0]
    (written,) = json.loads(out.read_text())["samples"]
    assert written["slots"][1]["n_prompt_tokens"] == 812
