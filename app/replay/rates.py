"""The cluster replay's default service model: this machine's engine rates, measured once.

A replica prefills at the engine's prefill tokens/s (a 256-token prompt) and decodes
each of its `slots` requests at the batch's aggregate tokens/s / slots, with slots =
the scheduler's default streams. The first measurement (a few seconds with the
bundled model) is kept beside the weight images, keyed by CPU, core count and model
file, and reused after that.
"""

from __future__ import annotations

import json
import os
import time

from engine.stream import SchedulerSettings

from .cluster import ServiceModel

PREFILL_TOKENS, DECODE_STEPS = 256, 4


def _store() -> str:
    from engine.cpu.weight_image import cache_root
    return os.path.join(os.path.dirname(cache_root()), "engine-rates.json")


def _machine_key(model_path: str) -> str:
    from ..system_info import cpu_model
    try:
        size = os.path.getsize(model_path)
    except OSError:
        size = 0
    return f"{cpu_model()}|{os.cpu_count()}|{os.path.basename(model_path)}|{size}"


def default_service(model_path: str | None = None, log=None) -> tuple[ServiceModel, str]:
    """(the measured service model, where it came from); measures and stores it the first time."""
    import engine as dl
    try:
        path = dl.resolve_model(model_path)
    except Exception as e:  # noqa: BLE001 - no bundled model: the rates must be given
        raise RuntimeError(f"no model to measure this machine's engine rates ({e}); give "
                           f"--prefill-rate, --decode-rate and --slots") from None
    key, store = _machine_key(path), _store()
    known: dict = {}
    try:
        with open(store, encoding="utf-8") as fh:
            known = json.load(fh)
        saved = known.get(key)
        if saved:
            return ServiceModel(**saved["service"]), f"measured {saved['when']} ({store})"
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        known = {}  # no store yet, or an unreadable one: measure again
    if log:
        log("measuring this machine's engine rates once (prefill and batch decode) ...")
    try:
        service = measure(path)
    except Exception as e:  # noqa: BLE001 - any load failure: say what to give instead
        raise RuntimeError(f"cannot measure this machine's engine rates with {path} ({e}); give "
                           f"--prefill-rate, --decode-rate and --slots") from None
    when = time.strftime("%Y-%m-%d", time.gmtime())
    try:
        os.makedirs(os.path.dirname(store), exist_ok=True)
        with open(store, "w", encoding="utf-8") as fh:
            json.dump({**known, key: {"service": service.__dict__, "when": when}}, fh)
    except OSError:
        pass  # a read-only cache dir: measure again next time
    return service, f"measured now with {os.path.basename(path)}"


def measure(model_path: str, slots: int = SchedulerSettings.max_streams) -> ServiceModel:
    """Prefill tokens/s of one 256-token prompt and per-request decode tokens/s with `slots`
    sessions decoding in one batch (each the best of 3: other processes only ever slow it)."""
    import engine as dl

    from ..scenario import sample_tokens
    m = dl.load_model(model_path)
    prompt = sample_tokens(m, PREFILL_TOKENS + slots)
    pool = dl.create_kv_pool(m)
    best = float("inf")
    for _ in range(3):
        s = dl.create_session(m, pool)
        t0 = time.perf_counter()
        dl.eval(m, s, prompt[:PREFILL_TOKENS])
        best = min(best, time.perf_counter() - t0)
        s.release()
    sessions = [dl.create_session(m, pool) for _ in range(slots)]
    dl.eval_batch(m, sessions, [prompt[i:i + 16] for i in range(slots)])
    tokens = [[t] for t in prompt[:slots]]
    step = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(DECODE_STEPS):
            dl.eval_batch(m, sessions, tokens)
        step = min(step, (time.perf_counter() - t0) / DECODE_STEPS)
    for s in sessions:
        s.release()
    return ServiceModel(prefill_rate=round(PREFILL_TOKENS / best, 1), decode_rate=round(1 / step, 2),
                        slots=slots)
