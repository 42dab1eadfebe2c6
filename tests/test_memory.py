"""The engine's memory: a prefill on an engine thread (the app's worker, the server's loop) reuses
its pages (engine/cpu/malloc.py), and a KV pool costs the pages written, not 2 MB a slab (engine/kv_pool.py).

The arena check runs in a fresh process: glibc's thresholds move with what a process has freed
before, so it starts the process at glibc's start values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from engine.kv_pool import KVPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BURSTS = """
import ctypes, json, os, resource, threading
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD and M_MMAP_THRESHOLD at glibc's start values, as a
libc.mallopt(-3, 128 << 10)  # process keeps them until it frees a mid-size mapped block
import engine
engine.tune_process()  # one arena, fixed thresholds (engine/cpu/malloc.py), as every entry point sets
from app.scenario import SCENARIO_DIR, load_scenario
from engine.loop import EngineLoop
from engine.sampler import SamplingParams
from engine.scheduler import Scheduler, SchedulerSettings

sc = load_scenario(os.path.join(SCENARIO_DIR, "eight_questions.json"))
loop = EngineLoop(engine.load_model(), SchedulerSettings(pool_pages=3428, cache_pages=3428))

def burst():  # empty cache, the eight questions' prefill, a few decode steps; page faults
    loop.scheduler.flush_cache()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for q in sc.prompts:
        loop.submit_now(system=sc.system, user=q, sampling=SamplingParams(temperature=0.0), max_new_tokens=4)
    loop.run_until_done()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

main = [burst() for _ in range(2)]
on_thread = []
thread = threading.Thread(target=lambda: on_thread.extend(burst() for _ in range(3)))
thread.start()
thread.join()
env = {k: v for k, v in os.environ.items() if k.startswith(("PREFIXLAB", "OPENBLAS", "OMP", "MALLOC"))}
print(json.dumps({"main": main, "thread": on_thread, "env": env}))
"""


def test_a_burst_finds_the_last_one_s_memory_on_any_thread(real_model):
    # after the first burst the freed temporaries stay in the one arena: glibc's own arena
    # for the thread handed them back after every burst (~88,000 faults a burst), and its
    # start thresholds did so on every thread (~23,000), as in one fresh-clone CI run
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", BURSTS], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    faults = json.loads(out.stdout.strip().splitlines()[-1])
    assert faults["main"][-1] < 2000, faults
    assert max(faults["thread"][1:]) < 2000, faults


def _resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_kv_pool_is_resident_only_where_it_was_written(real_model):
    # the app's default pool: 3,428 pages, 2.5 GB of K and V that a session fills page by page
    pool = KVPool(real_model.config, max_pages=3428)
    before = _resident_bytes()
    pool.k[:, 0] = 1.0                       # one page of every layer: 30 x 12 KB
    pool.v[:, 0] = 1.0
    written = pool.bytes_per_page
    grew = _resident_bytes() - before
    # with 2 MB pages each layer's write would have made 4 MB resident (K and V): 120 MB
    assert grew < written + (4 << 20), (grew, written)
    assert float(pool.k[:, 1].max()) == 0.0  # the rest still reads as zeros
