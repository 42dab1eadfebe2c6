"""The disk tier fails closed (issue 45): a full disk, a truncated tier file or pages the disk
zeroed give a miss and one log line, never a signal and never a wrong answer."""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import openai

import engine as dl
from engine import disk_tier

from .full_disk import small_tmpfs
from .prefix_helpers import assert_session_sees, evaluated, make_pool, teardown


def tier_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("disk tier:")]


def demoted(tokens, disk_pages: int = 8):
    """A fake pool and a cache of one pool page over a disk tier holding the rest of `tokens`."""
    pool = make_pool(page_rows=4)
    cache = dl.create_prefix_cache(max_pages=1, disk_pages=disk_pages)
    a = evaluated(pool, tokens)
    dl.prefix_insert(cache, pool, a, tokens)
    a.release()
    return pool, cache


def test_a_write_the_disk_refuses_drops_the_page_with_one_line(monkeypatch, caplog):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(disk_tier.os, "pwrite", full)
    caplog.set_level(logging.WARNING, "prefixlab.cache")
    tokens = list(range(100, 116))
    pool, cache = demoted(tokens)
    assert len(cache.tier) == 0 and cache.tier.write_errors == 3 and cache.counters.demoted_pages == 0
    [line] = tier_lines(caplog)                       # three failures, one line
    assert "not stored" in line and "No space left on device" in line
    s = dl.Session(pool=pool)
    assert dl.prefix_attach(cache, pool, s, tokens + [1]) == 4    # the pool's page; the rest is prefilled
    assert_session_sees(s, tokens[:4])
    teardown([s], cache, pool)


def test_a_zeroed_tier_page_is_a_miss_and_the_logits_are_right(tiny_model, caplog):
    m = tiny_model
    p1 = dl.encode(m, "The quick brown fox jumps over the lazy dog again and again")
    p2 = p1 + dl.encode(m, " and then it sleeps")
    caplog.set_level(logging.WARNING, "prefixlab.cache")

    def tail_logits(disk_pages: int, zero: bool):
        pool = dl.create_kv_pool(m, page_rows=4)
        cache = dl.create_prefix_cache(max_pages=1, disk_pages=disk_pages)
        a = dl.create_session(m, pool)
        dl.eval(m, a, p1)
        dl.prefix_insert(cache, pool, a, p1)
        dl.release_kv_pages(a)
        if zero:  # a disk error: every stored page reads back as zeros
            fd = cache.tier._file.fileno()
            os.pwrite(fd, bytes(os.fstat(fd).st_size), 0)
        s = dl.create_session(m, pool)
        matched = dl.prefix_attach(cache, pool, s, p2)
        return matched, dl.eval(m, s, p2[matched:]), cache

    matched_ref, ref, _ = tail_logits(0, False)          # the pool's one page, no tier
    matched, got, cache = tail_logits(64, True)
    assert matched == matched_ref == 4                    # the zeroed pages are misses...
    assert cache.counters.disk_hit_pages == 0 and cache.tier.bad_pages == 1
    np.testing.assert_array_equal(got, ref)               # ...and the answer is the right one
    [line] = tier_lines(caplog)
    assert "not loaded back" in line and "checksum differs" in line


TRUNCATE = """
import os
import engine as dl
from tests.test_disk_tier_faults import demoted
from tests.prefix_helpers import assert_session_sees
tokens = list(range(100, 116))
pool, cache = demoted(tokens)
assert len(cache.tier) == 3
os.ftruncate(cache.tier._file.fileno(), 0)   # what a full or failing disk can leave
s = dl.Session(pool=pool)
n = dl.prefix_attach(cache, pool, s, tokens + [1])
assert_session_sees(s, tokens[:n])
print(n, cache.tier.bad_pages, len(cache.tier))
"""


def test_a_truncated_tier_file_is_a_miss_not_a_signal():
    # a subprocess: a memory map of a truncated file would kill it with SIGBUS, not pytest
    done = subprocess.run([sys.executable, "-c", TRUNCATE], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.split() == ["4", "1", "2"]        # the pool's page; one bad page, two left
    assert done.stderr.count("disk tier:") == 1 and "truncated" in done.stderr


def test_the_tier_file_is_private(tiny_model):
    pool = dl.create_kv_pool(tiny_model, page_rows=4)
    cache = dl.create_prefix_cache(max_pages=1, disk_pages=4)
    cache.bind(pool)
    assert os.fstat(cache.tier._file.fileno()).st_mode & 0o777 == 0o600


QUESTIONS = [("You paint walls in bright colours for small shops. " * 3, "Red?"),
             ("You fix old bicycles and answer questions about gears. " * 3, "Chain?"),
             ("You bake bread every morning before the sun rises. " * 3, "Rye?")]


def serve_answers(model_path: str, args: list[str], env: dict | None = None) -> tuple[list[str], str, int]:
    """`prefixlab serve` with `args` asked QUESTIONS twice, stopped with SIGINT: (answers, output, rc)."""
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", "0", "--model", model_path,
           "--page-rows", "4", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})})
    guard = threading.Timer(240, proc.kill)
    guard.start()
    answers = []
    try:
        lines = iter(proc.stdout.readline, "")
        seen = [next(lines)]
        url = re.search(r"listening on (http://\S+)/v1", seen[0]).group(1)
        for line in lines:
            seen.append(line)
            if "ready" in line:
                break
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
        for system, user in QUESTIONS + QUESTIONS:   # the second round can hit the tiers
            reply = client.chat.completions.create(model="m", max_tokens=4, temperature=0, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": user}])
            answers.append(reply.choices[0].message.content)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        guard.cancel()
    return answers, "".join(seen) + out, proc.returncode


def test_serve_on_a_full_disk_keeps_answering_as_without_a_cache(tiny_gguf_path, tmp_path):
    """The disk tier's folder and --persist-cache on a 16 KiB tmpfs: the tier fills after eight
    pages, later evictions are dropped (one line), the save at exit fails (one line); every
    answer is the --no-cache answer and serve exits 0."""
    want, _, rc = serve_answers(tiny_gguf_path, ["--no-cache"])
    assert rc == 0
    with small_tmpfs(tmp_path / "full", "16k") as full:
        got, out, rc = serve_answers(tiny_gguf_path, ["--cache-pages", "4", "--disk-tier-pages", "64",
                                                      "--persist-cache", str(full / "kv")],
                                     env={"TMPDIR": str(full)})
        assert sorted(os.listdir(full / "kv")) == []      # no file, no temporary file
    assert rc == 0, out
    assert got == want
    assert "Traceback" not in out and "Bus error" not in out
    tier = [ln for ln in out.splitlines() if "disk tier:" in ln]
    assert len(tier) == 1 and "No space left on device" in tier[0], out
    saved = [ln for ln in out.splitlines() if "not saved" in ln]
    assert len(saved) == 1 and "No space left on device" in saved[0], out
