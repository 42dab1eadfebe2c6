"""--persist-cache (docs/design.md §12): the cache outlives the process; a damaged or foreign
file is refused with one line, moved aside, and the cache starts cold."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from app.cache_persist import FILE_NAME, PersistedCache
from engine.loop import EngineLoop
from engine.scheduler import Scheduler, SchedulerSettings

SYSTEM = "You are a helpful assistant. " * 6
QUESTION = "Name a colour."


def answered(model, tmp_path, settings=None, persist=True, out=None):
    """A scheduler (its cache kept in tmp_path when `persist`) that answered one question."""
    loop = EngineLoop(model, settings or SchedulerSettings(page_rows=4))
    sch = loop.scheduler
    kept = PersistedCache(str(tmp_path), sch, out or io.StringIO()) if persist else None
    loaded = kept.load() if kept else 0
    rid = loop.submit_now(system=SYSTEM, user=QUESTION, max_new_tokens=6)
    loop.run_until_done()
    return sch, kept, loaded, sch.record(rid)


def test_a_restart_hits_the_saved_cache_with_the_same_greedy_answer(tiny_model, tmp_path):
    sch, kept, loaded, first = answered(tiny_model, tmp_path)
    assert loaded == 0 and first.n_cached == 0
    assert kept.save() == len(sch.cache.pages) > 0
    _, _, loaded, again = answered(tiny_model, tmp_path)
    assert loaded > 0 and again.n_cached > 0
    *_, cold = answered(tiny_model, tmp_path, SchedulerSettings(page_rows=4, cache_enabled=False),
                        persist=False)
    assert again.text == cold.text == first.text


def refused(model, tmp_path, settings=None) -> tuple[str, Scheduler]:
    out = io.StringIO()
    sch = Scheduler(model, settings or SchedulerSettings(page_rows=4))
    assert PersistedCache(str(tmp_path), sch, out).load() == 0
    assert len(sch.cache.pages) == 0 and sch.pool.num_used_pages == 0   # a cold cache, nothing half-made
    assert not os.path.exists(tmp_path / FILE_NAME)                       # moved aside
    assert len([f for f in os.listdir(tmp_path) if ".rejected-" in f]) == 1
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "not loaded" in lines[0] and "cold cache" in lines[0]
    return lines[0], sch


def saved_file(model, tmp_path) -> bytes:
    _, kept, _, _ = answered(model, tmp_path)
    kept.save()
    return (tmp_path / FILE_NAME).read_bytes()


@pytest.mark.parametrize("where", ["body", "header", "kv"])
def test_a_flipped_byte_is_refused(tiny_model, tmp_path, where):
    data = bytearray(saved_file(tiny_model, tmp_path))
    head = int.from_bytes(data[8:16], "little")
    at = {"header": 16 + head // 2, "body": 16 + head + 10, "kv": len(data) - 5}[where]
    data[at] ^= 0x40
    (tmp_path / FILE_NAME).write_bytes(bytes(data))
    line, _ = refused(tiny_model, tmp_path)
    assert "corrupt" in line or "differs" in line


def test_a_truncated_file_is_refused(tiny_model, tmp_path):
    data = saved_file(tiny_model, tmp_path)
    (tmp_path / FILE_NAME).write_bytes(data[:len(data) * 2 // 3])
    line, _ = refused(tiny_model, tmp_path)
    assert "truncated" in line


def test_another_models_file_is_refused(tiny_model, tiny_untied_model, tmp_path):
    saved_file(tiny_untied_model, tmp_path)
    line, _ = refused(tiny_model, tmp_path)
    assert "model_sha256 differs" in line


def test_other_page_rows_or_kv_dtype_are_refused(tiny_model, tmp_path):
    saved_file(tiny_model, tmp_path)
    line, _ = refused(tiny_model, tmp_path, SchedulerSettings(page_rows=8))
    assert "page_rows differs: the file has 4, this run 8" in line
    saved_file(tiny_model, tmp_path)
    line, _ = refused(tiny_model, tmp_path, SchedulerSettings(page_rows=4, kv_dtype="float16"))
    assert "kv_dtype differs" in line


KILLER = """
import sys, io
from engine import load_model
from engine.loop import EngineLoop
from engine.scheduler import Scheduler, SchedulerSettings
from app.cache_persist import PersistedCache
loop = EngineLoop(load_model(sys.argv[1]), SchedulerSettings(page_rows=4, max_queue=64))
sch = loop.scheduler
for i in range(40):
    loop.submit_now(system="persist " * 30, user=f"question {i} " * 20, max_new_tokens=1)
loop.run_until_done()
kept = PersistedCache(sys.argv[2], sch, io.StringIO())
print("ready", flush=True)
while True:
    kept.save()
"""


def test_a_process_killed_mid_write_leaves_a_readable_cache(tiny_model, tiny_gguf_path, tmp_path):
    saved_file(tiny_model, tmp_path)  # the old file
    proc = subprocess.Popen([sys.executable, "-c", KILLER, tiny_gguf_path, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.7)   # many saves in flight
    finally:
        proc.kill()
        proc.wait()
    sch = Scheduler(tiny_model, SchedulerSettings(page_rows=4))
    out = io.StringIO()
    assert PersistedCache(str(tmp_path), sch, out).load() > 0, out.getvalue()


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", "run", "--max-new", "8", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.model
def test_prefixlab_run_twice_hits_and_answers_as_without_cache(real_model, tmp_path):
    store = tmp_path / "kv"
    common = ["--system", "You are a helpful assistant who answers briefly and politely in English.",
              "--prompt", "What is 2+2?"]
    records = []
    for i, extra in enumerate((["--persist-cache", str(store)], ["--persist-cache", str(store)],
                               ["--no-cache"])):
        out = tmp_path / f"r{i}.json"
        done = run_cli(*common, *extra, "--json", str(out))
        assert done.returncode == 0, done.stderr
        records.append(json.loads(out.read_text())["requests"][0])
    assert records[0]["n_cached"] == 0 and records[1]["n_cached"] > 0
    assert records[1]["text"] == records[2]["text"]
    # a damaged file: one line, exit 0, a cold cache
    data = bytearray((store / FILE_NAME).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (store / FILE_NAME).write_bytes(bytes(data))
    out = tmp_path / "r3.json"
    done = run_cli(*common, "--persist-cache", str(store), "--json", str(out))
    assert done.returncode == 0
    assert [ln for ln in done.stderr.splitlines() if "not loaded" in ln] != []
    assert json.loads(out.read_text())["requests"][0]["n_cached"] == 0


def serve_once(model_path: str, store, system: str) -> tuple[int, str]:
    """Start `prefixlab serve --persist-cache`, ask one question, stop it; (cached tokens, output)."""
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", "0", "--model", model_path,
           "--page-rows", "4", "--persist-cache", str(store)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    guard = threading.Timer(180, proc.kill)
    guard.start()
    try:
        lines = iter(proc.stdout.readline, "")
        url = re.search(r"listening on (http://\S+)/v1", next(lines)).group(1)
        seen = []
        for line in lines:  # up to "ready": the cache's line comes before it
            seen.append(line)
            if "ready" in line:
                break
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        reply = client.chat.completions.create(model="m", max_tokens=3, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "Paint?"}])
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        guard.cancel()
    assert proc.returncode == 0, out
    return reply.usage.prompt_tokens_details.cached_tokens, "".join(seen) + out


def test_prefixlab_serve_keeps_its_cache_across_a_restart(tiny_gguf_path, tmp_path):
    system = "You paint walls. " * 8
    cached, out = serve_once(tiny_gguf_path, tmp_path, system)
    assert cached == 0 and "saved" in out and (tmp_path / FILE_NAME).exists()
    cached, out = serve_once(tiny_gguf_path, tmp_path, system)
    assert "loaded" in out and cached > 0
