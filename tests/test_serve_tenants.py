"""`prefixlab serve` with API keys: loading, authentication, tenants and salts, a full queue, a used port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from app.bench.serve import free_port
from app.cli import main
from app.scenario import REPO_ROOT
from app.serve.runner import ServeError, Server, bind
from engine.prefix_cache import blake2b_64
from engine.scheduler import SchedulerSettings
from tests.serve_helpers import pages_held_by_sessions, wait_idle
from tests.wait import wait_until

pytestmark = pytest.mark.model
KEYS = ["key-alice", "key-bob"]
SYSTEM = "You are the concierge of the Grand Hotel. Breakfast is served from seven to ten. Be brief."


def namespace_blind(data: bytes) -> int:
    """A forced collision: the root page's key ignores the namespace, so tenants' keys coincide."""
    if data.startswith(b"ns:"):
        data = data[data.index(b"\0") + 1:]
    return blake2b_64(data)


@pytest.fixture(scope="module")
def served(real_model):
    """A server whose model 'loads' until the gate opens; what it answered meanwhile."""
    gate = threading.Event()

    def load():
        gate.wait(60)
        return real_model, SchedulerSettings(max_streams=1, max_queue=1)

    def prepare(sch) -> None:
        sch.cache.hash_fn = namespace_blind

    srv = Server(load, port=0, api_keys=KEYS, default_max_tokens=3, prepare=prepare).start()
    headers = {"authorization": f"Bearer {KEYS[0]}"}
    while_loading = {
        "health": httpx.get(srv.url + "/health"),
        "chat": httpx.post(srv.url + "/v1/chat/completions", headers=headers,
                           json={"messages": [{"role": "user", "content": "hi"}]}),
        "models": httpx.get(srv.url + "/v1/models", headers=headers),
    }
    gate.set()
    srv.engine.ready.wait(60)
    yield srv, while_loading
    srv.stop()


def client_for(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def cached(client, system: str = SYSTEM, salt: str | None = None) -> int:
    extra = {"cache_salt": salt} if salt else None
    r = client.chat.completions.create(model="m", max_tokens=1, extra_body=extra, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "When is breakfast?"}])
    return r.usage.prompt_tokens_details.cached_tokens


def test_503_while_the_model_loads_then_200(served):
    srv, loading = served
    assert loading["health"].status_code == 503 and loading["health"].json()["status"] == "loading"
    for name in ("chat", "models"):
        assert loading[name].status_code == 503
        assert "loading" in loading[name].json()["error"]["message"]
    assert httpx.get(srv.url + "/health").status_code == 200


def test_wrong_or_missing_key_is_401_and_the_right_one_is_served(served):
    srv, _ = served
    with pytest.raises(openai.AuthenticationError):
        client_for(srv, "key-mallory").models.list()
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert [m.id for m in client_for(srv, KEYS[1]).models.list()]


def test_two_tenants_never_share_a_page_even_when_their_keys_collide(served):
    srv, _ = served
    alice, bob = client_for(srv, KEYS[0]), client_for(srv, KEYS[1])
    assert cached(alice) == 0
    assert cached(alice) > 0           # alice hits her own pages
    # Same prompt, same page key (the hash ignores the namespace), but bob is another tenant:
    # tokens verify the namespace too, so he attaches nothing.
    cache = srv.engine.scheduler.cache
    page0 = next(iter(cache.pages.values()))
    assert cache.page_key(None, page0.tokens, "another-tenant") == page0.key
    assert cached(bob) == 0
    assert cached(bob) == 0


def test_cache_salt_is_its_own_namespace(served):
    srv, _ = served
    alice = client_for(srv, KEYS[0])
    system = "You are the gardener of the Grand Hotel. Answer in one short sentence."
    assert cached(alice, system, salt="s1") == 0
    assert cached(alice, system, salt="s1") > 0
    assert cached(alice, system, salt="s2") == 0


def test_a_request_without_max_tokens_gets_the_servers_default(served):
    srv, _ = served
    r = client_for(srv, KEYS[0]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Tell me a long story about a dragon."}])
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_full_queue_is_503_and_the_server_keeps_serving(served):
    srv, _ = served
    headers = {"authorization": f"Bearer {KEYS[0]}"}
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 300,
            "stream": True}
    url = srv.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers) as running:
        lines = running.iter_lines()
        next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
        with httpx.stream("POST", url, json=body, headers=headers) as queued:
            assert queued.status_code == 200  # accepted: it waits for the one stream
            full = httpx.post(url, headers=headers, json={"messages": [{"role": "user", "content": "hi"}]})
    assert full.status_code == 503 and full.json()["error"]["code"] == "server_busy"
    wait_idle(srv)
    assert pages_held_by_sessions(srv) == 0
    ok = client_for(srv, KEYS[0]).chat.completions.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert ok.usage.completion_tokens == 2


def test_port_in_use_is_a_clear_error_at_start(served):
    srv, _ = served
    with pytest.raises(ServeError, match=f"127.0.0.1:{srv.http.port}: the port is in use"):
        bind("127.0.0.1", srv.http.port)
    with pytest.raises(SystemExit, match="port is in use"):
        main(["serve", "--port", str(srv.http.port)])  # refused before loading the model


def test_stopping_the_server_ends_open_streams_cleanly(real_model):
    from tests.serve_helpers import scheduler_on, start_server

    srv = start_server(scheduler_on(real_model))
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 500,
            "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
        threading.Thread(target=srv.stop).start()
        rest = list(lines)  # the stream ends: a finish chunk and [DONE], no broken connection
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    assert any('"finish_reason": "stop"' in line for line in rest)


def test_an_engine_failure_is_a_500_error_object_and_the_next_request_is_served(served):
    srv, _ = served
    sch = srv.engine.scheduler
    real_step = sch.step

    def broken_step():
        del sch.step  # fail once, then the real method again
        raise FloatingPointError("a step broke")

    sch.step = broken_step
    headers = {"authorization": f"Bearer {KEYS[0]}"}
    r = httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 500 and "Traceback" not in r.text and r.json()["error"]["message"]
    assert "a step broke" in srv.engine.loop.step_error
    assert sch.step == real_step
    wait_idle(srv)
    assert pages_held_by_sessions(srv) == 0
    ok = client_for(srv, KEYS[0]).chat.completions.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize("sig, background",
                         [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["ctrl-c", "sigterm", "background-job"])
def test_the_prefixlab_serve_command_serves_until_interrupted(sig, background):
    """Ctrl+C and SIGTERM (docker stop, systemd) both stop it cleanly, also when it was started as
    a script's background job, which inherits SIGINT ignored."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OPENBLAS_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--max-streams", "1"]
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if background else None
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=ignore)
    try:
        url = f"http://127.0.0.1:{port}"
        def healthy() -> bool:
            assert proc.poll() is None, "prefixlab serve exited before it was ready"
            return httpx.get(url + "/health").status_code == 200

        wait_until(healthy, 120, "prefixlab serve to start", interval=0.1, ignore=(httpx.ConnectError,))
        health = httpx.get(url + "/health").json()
        assert health["kv_budget_bytes"] > 0 and health["kv_budget_pages"] > 0  # bounded by default
        r = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0).chat.completions.create(
            model="gpt-4o", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens == 2
    finally:
        proc.send_signal(sig)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
            pytest.fail(f"prefixlab serve did not stop on {signal.Signals(sig).name}: {out[-2000:]}")
    assert proc.returncode == 0, out
    assert f"ready; point clients at OPENAI_BASE_URL=http://127.0.0.1:{port}/v1" in out
    assert "prefixlab serve: stopping" in out
    assert "KV budget" in out and "of RAM" in out


def test_friendliness_shows_each_tenant_only_its_own_prompts(served):
    srv, _ = served
    secret = "Alice's secret launch code is PINEAPPLE-7741. Summarise it."
    r = client_for(srv, KEYS[0]).chat.completions.create(
        model="m", max_tokens=1, user="alice-app", messages=[{"role": "user", "content": secret}])
    assert r.usage.completion_tokens == 1
    wait_idle(srv)
    seen = {}
    for key in KEYS:
        got = httpx.get(srv.url + "/v1/prefixlab/friendliness", headers={"authorization": f"Bearer {key}"})
        seen[key] = got.text
    assert "alice-app" in seen[KEYS[0]]
    assert "alice-app" not in seen[KEYS[1]] and "PINEAPPLE" not in seen[KEYS[1]]
