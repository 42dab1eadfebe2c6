"""Sweeps: every (page size, budget, policy) of a trace, in parallel processes or on Dask.

Each configuration is an independent replay that streams the trace file itself,
so a worker needs only the file's path (on a Dask cluster: a path every worker
can read) and sends back one small result.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed

from .results import DEFAULT_POLICY, ReplayConfig, ReplayResult
from .simulate import replay
from .trace import TraceSource

Progress = Callable[[int, int], None]  # (done, total)


def configurations(page_rows: Iterable[int | None] = (None,), budgets: Iterable[int | None] = (None,),
                   policies: Iterable[str] = (DEFAULT_POLICY,),
                   disk_budgets: Iterable[int | None] = (None,)) -> list[ReplayConfig]:
    """Every combination, in the order page size, then budget, then policy, then disk tier."""
    return [ReplayConfig(p, b, pol, d)
            for p, b, pol, d in itertools.product(page_rows, budgets, policies, disk_budgets)]


def run_sweep(source: TraceSource, configs: list[ReplayConfig], workers: int | None = None,
              dask_scheduler: str | None = None, progress: bool | Progress = False,
              fn: Callable = replay) -> list[ReplayResult]:
    """Replay every configuration; results in the order of `configs`.

    One configuration (or `workers=1`) runs in this process; more run in a pool of
    `workers` processes (default: one per core), or on the Dask cluster at
    `dask_scheduler`. `progress` True shows a tqdm bar; a callable gets (done, total).
    `fn(source, config)` runs one configuration (a module-level function: it is pickled).
    """
    if source.tokenize is not None:
        raise ValueError("convert an OpenAI log to a prefixlab trace first (see app.replay.record)")
    report = _progress(progress, len(configs))
    try:
        if dask_scheduler:
            return _on_dask(source, configs, dask_scheduler, report, fn)
        workers = workers or os.cpu_count() or 1
        if workers == 1 or len(configs) == 1:
            out = []
            for c in configs:
                out.append(fn(source, c))
                report(len(out))
            return out
        return _in_processes(source, configs, workers, report, fn)
    finally:
        report(None)


def _in_processes(source, configs, workers, report, fn) -> list[ReplayResult]:
    # spawn: a fresh interpreter per worker, never a fork of a process that runs Qt.
    ctx = multiprocessing.get_context("spawn")
    results: list[ReplayResult | None] = [None] * len(configs)
    with ProcessPoolExecutor(max_workers=min(workers, len(configs)), mp_context=ctx) as pool:
        futures = {pool.submit(fn, source, c): i for i, c in enumerate(configs)}
        for done, fut in enumerate(as_completed(futures), 1):
            results[futures[fut]] = fut.result()
            report(done)
    return results


def _on_dask(source, configs, address, report, fn) -> list[ReplayResult]:
    try:
        from dask.distributed import Client
        from dask.distributed import as_completed as dask_completed
    except ImportError:
        raise RuntimeError("--dask-scheduler needs dask.distributed: pip install 'prefixlab[dask]'") from None
    try:
        client = Client(address, timeout="10s")
    except OSError as e:
        raise RuntimeError(f"cannot reach the Dask scheduler at {address}: {e}") from None
    try:
        futures = client.map(fn, [source] * len(configs), configs, pure=False)
        index = {f.key: i for i, f in enumerate(futures)}
        results: list[ReplayResult | None] = [None] * len(configs)
        for done, fut in enumerate(dask_completed(futures), 1):
            results[index[fut.key]] = fut.result()
            report(done)
        return results
    finally:
        client.close()


def _progress(progress, total: int) -> Callable[[int | None], None]:
    """A reporter: call it with the count done, and with None at the end."""
    if callable(progress):
        return lambda done: done is not None and progress(done, total)
    if not progress:
        return lambda done: None
    from tqdm import tqdm
    bar = tqdm(total=total, unit="config", desc="replay", leave=False)

    def report(done: int | None) -> None:
        if done is None:
            bar.close()
        else:
            bar.update(done - bar.n)
    return report
