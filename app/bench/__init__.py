"""`prefixlab bench`: measure the engine, the prefix cache, the scheduler and the UI thread.

Everything runs in one process (load/RSS and the UI figure in child processes) and every
ratio divides two numbers of the same run. The table shows each figure with its target;
--json writes every figure, the raw measurements and the machine to a file.

Sections (--only), each figure filed under its feature in the table and the JSON:
prefill, decode, batch, load (feature "engine"; "engine" = all four; batch also runs W8 in a
child process: batch8_step_ratio, its 8-stream over its 1-stream decode step, and
w8_peak_rss_mb, feature "W8 workload"),
cache ("prefix cache"; it also times a 16,384-page snapshot, "snapshots"), scheduler
("scheduler"), ui ("desktop app"), kv_events ("KV events": the watcher's block events per
second), serve ("OpenAI server": 8 streaming clients against `prefixlab serve` and
llama-cpp-python's server; not in --quick), replay ("trace replay": the shipped Mooncake
trace, one configuration and a sweep across cores), cluster ("clusters": that trace over 1-8
replicas x six routers in a pool and on a Dask LocalCluster, and a million-request synthetic
trace's peak memory), blas: a diagnostic of decode and prefill with 1 OpenBLAS thread vs the
default (no target; not in --quick), and llama_cpp ("llama.cpp"): llama.cpp's prefill and
decode on the same GGUF, when llama-cpp-python is installed (no target; not in --quick), and
w8 ("W8 workload": whole `prefixlab run` processes of the W8 workload: the first token, then
the wall time idle and with one and two busy processes; not in --quick), and soak ("soak":
1,000 distinct chats against `prefixlab serve` with its default settings: peak RSS against
its stated KV budget, the last 100 requests' latency over the first 100's; --quick: 60
requests; only when --only names it), and tiers ("disk tier"): the disk tier's load-back
time per page beside the prefill time it spares.
--peer llama-cpp adds the peer section ("llama.cpp peer"): llama-cpp-python on the same
GGUF, prefill, decode, eight streams and the W8 workload, as ratios with their targets
(its llama.cpp tok/s are the llama_cpp_* figures, which the llama_cpp section then reuses).
twin ("twin"): 180 requests in bursts sent to `prefixlab serve`, calibrated on its own passes
between the bursts, and predicted by the twin: the error of TTFT p50 and p90 (not in --quick);
twin_scale ("twin"): 10,000 synthetic requests through one twin replica in a child process:
requests and passes a second, peak RSS and its growth (not in --quick).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

SECTIONS = ("prefill", "decode", "batch", "load", "cache", "scheduler", "ui", "kv_events", "serve", "replay",
            "cluster", "blas", "llama_cpp", "w8", "peer", "tiers", "soak", "twin", "twin_scale")
ALIASES = {"engine": ("prefill", "decode", "batch", "load"), "all": SECTIONS}
# left out of --quick unless --only names them (serve: child servers; llama_cpp: llama.cpp's run;
# w8: a minute of whole processes, with busy ones)
QUICK_SKIPS = ("blas", "serve", "llama_cpp", "w8", "peer", "soak", "twin", "twin_scale")
OPT_IN = ("peer", "soak")  # run only when asked for (--peer, or --only naming it; soak: ~30 min)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure speed, memory and cache figures against their targets",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    p.set_defaults(func=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=argparse.SUPPRESS,
                   help="GGUF model file or built-in name (gemma3-270m; default: the bundled SmolLM2)")
    p.add_argument("--json", metavar="OUT.json", help="write every figure and the machine to this file")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds, for tests); not for targets")
    p.add_argument("--only", metavar="NAME,...",
                   help=f"run only these sections: {', '.join(SECTIONS)} (or engine, all)")
    p.add_argument("--peer", choices=["llama-cpp"],
                   help="also run llama-cpp-python on the same model and print every ratio")


def parse_only(text: str | None, quick: bool = False) -> list[str]:
    """Section names from --only, in the bench's order; ValueError names an unknown one."""
    if not text:
        return [s for s in SECTIONS if not (quick and s in QUICK_SKIPS) and s not in OPT_IN]
    chosen: set[str] = set()
    for name in (n.strip().lower() for n in text.split(",") if n.strip()):
        if name in ALIASES:
            chosen.update(ALIASES[name])
        elif name in SECTIONS:
            chosen.add(name)
        else:
            raise ValueError(
                f"unknown bench section '{name}'; choose from {', '.join(SECTIONS)}, engine, all")
    if not chosen:
        raise ValueError("--only names no section")
    return [s for s in SECTIONS if s in chosen]


def run(args) -> int:
    try:
        sections = parse_only(args.only, args.quick)
        if getattr(args, "peer", None) and "peer" not in sections:
            sections.append("peer")
    except ValueError as e:
        raise SystemExit(f"prefixlab bench: {e}") from None
    results = run_bench(getattr(args, "model", None), quick=args.quick, sections=sections,
                        log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(results))
    if args.json:
        write_json(results, args.json)
        print(f"\nwrote {args.json}")
    return 0


def _load_model(path: str, image_dir: str | None):
    """The model, from the weight image the load children just wrote in `image_dir` if given."""
    import engine as dl

    if image_dir is None:
        return dl.load_model(path)
    saved = os.environ.get("PREFIXLAB_CACHE_DIR")
    os.environ["PREFIXLAB_CACHE_DIR"] = image_dir
    try:
        return dl.load_model(path)
    finally:
        if saved is None:
            os.environ.pop("PREFIXLAB_CACHE_DIR", None)
        else:
            os.environ["PREFIXLAB_CACHE_DIR"] = saved


def _model_facts(m) -> dict:
    """What the result says about the model it measured."""
    return {"name": m.name, "arch": m.arch, "quant": m.quant, "n_params": m.n_params,
            "file_size": m.file_size, "matmul_bytes": m.weights.matmul_bytes(),
            "from_image": m.from_image, "config": dict(m.config.__dict__),
            "description": m.describe(), "quant_mix": m.quant_mix,
            "layout": {"layout": m.backend.layout, **m.backend.layout_record}, "pages": m.backend.pages}


def run_bench(model_path: str | None = None, quick: bool = False, sections=SECTIONS, log=None) -> dict:
    """Run the chosen sections; return the whole result (what --json writes)."""
    import engine as dl

    from . import cache as bench_cache
    from . import engine as bench_engine
    from . import peer as bench_peer
    from . import sched as bench_sched
    from . import serve as bench_serve
    from . import ui as bench_ui
    from .common import machine_info

    log = log or (lambda msg: None)
    sections = list(sections)
    path = dl.resolve_model(model_path)  # a file, or a built-in name such as gemma3-270m
    t_start = time.perf_counter()
    result: dict = {"schema": 2, "quick": quick, "sections_run": sections, "machine": machine_info(),
                    "model": {"path": path}, "figures": {}, "details": {}, "errors": {}}
    tmp_cache = bench_engine.temp_cache_dir()
    image_ready = False

    def section(name: str, fn) -> None:
        log(f"bench: {name} ...")
        t0 = time.perf_counter()
        try:
            figures, details = fn()
        except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
            result["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"bench: {name} FAILED: {e}")
            return
        result["figures"].update(figures)
        result["details"][name] = {**details, "section_s": time.perf_counter() - t0}

    try:
        if "load" in sections:
            section("load", lambda: bench_engine.load_figures(path, tmp_cache, quick))
            image_ready = "load" not in result["errors"]
        needs_model = {"prefill", "decode", "batch", "scheduler", "serve", "blas", "peer",
                       "tiers"} & set(sections)
        if needs_model:
            log("bench: loading the model ...")
            m = _load_model(path, tmp_cache if image_ready else None)
            result["model"].update(_model_facts(m))
            if "prefill" in sections:
                section("prefill", lambda: bench_engine.prefill_figures(m, quick))
            if "decode" in sections or "batch" in sections:  # the batch speedup needs single-stream
                batch = "batch" in sections
                section("decode", lambda: bench_engine.decode_figures(m, quick, run_batch=batch))
            if "batch" in sections:  # W8's own timeline: 8 streams' step over one's, and its peak RSS
                from .w8_steps import w8_step_figures
                section("w8_steps", lambda: w8_step_figures(path, tmp_cache if image_ready else None, quick))
            if "blas" in sections:
                section("blas", lambda: bench_engine.blas_thread_figures(m, quick))
            if "peer" in sections:
                section("peer", lambda: bench_peer.peer_figures(m, quick))
        if "cache" in sections:
            section("cache", lambda: bench_cache.cache_figures(quick))
        if "scheduler" in sections:
            section("scheduler", lambda: bench_sched.scheduler_figures(m, quick))
        if "tiers" in sections:
            from .tiers import tier_figures
            section("tiers", lambda: tier_figures(m, quick))
        if "ui" in sections:
            section("ui", lambda: bench_ui.ui_figures(path, quick, tmp_cache if image_ready else None))
        if "serve" in sections:
            section("serve", lambda: bench_serve.serve_figures(path, quick, m.tokenizer.eos_ids))
        _model_free_sections(sections, section, path, quick, result["figures"])
    finally:
        shutil.rmtree(tmp_cache, ignore_errors=True)
    result["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    result["total_s"] = time.perf_counter() - t_start
    result["targets"] = target_summary(result["figures"])
    return result


def _model_free_sections(sections: list, section, path: str, quick: bool, figures: dict) -> None:
    """The sections that load what they need themselves (servers, traces, whole processes)."""
    if "kv_events" in sections:
        from .kv_events import kv_events_figures
        section("kv_events", lambda: kv_events_figures(quick))
    if "soak" in sections:
        from .soak import soak_figures
        section("soak", lambda: soak_figures(path, quick))
    if "twin" in sections:
        from .twin import twin_figures
        section("twin", lambda: twin_figures(path, quick))
    if "twin_scale" in sections:
        from .twin_scale import twin_scale_figures
        section("twin_scale", lambda: twin_scale_figures(quick))
    if "replay" in sections:
        from . import replay as bench_replay
        section("replay", lambda: bench_replay.replay_figures(quick))
    if "cluster" in sections:
        from .cluster import cluster_figures
        section("cluster", lambda: cluster_figures(quick))
    if "w8" in sections:
        from .w8 import w8_figures
        section("w8", lambda: w8_figures(path, quick))
    if "llama_cpp" in sections:  # last: it compares with the figures measured before it
        from .llama_cpp import llama_cpp_figures
        section("llama_cpp", lambda: llama_cpp_figures(path, quick, figures))


def target_summary(figures: dict) -> dict:
    """Figures with a target: how many pass, and the names of those that miss."""
    with_target = {k: f for k, f in figures.items() if f.get("target") is not None}
    missed = [k for k, f in with_target.items() if f["pass"] is False]
    return {"checked": len(with_target), "passed": len(with_target) - len(missed), "missed": missed}


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a == 0 or 0.01 <= a < 1e6:
        return f"{v:.3g}" if a < 100 else f"{v:,.0f}"
    return f"{v:.3e}"


def format_table(result: dict) -> str:
    """The figures as a readable table, grouped by feature, with target and pass/fail."""
    rows = [("feature", "figure", "value", "unit", "target", "result")]
    for name, f in result["figures"].items():
        target = f"{f['op']} {_fmt(f['target'])}" if f.get("target") is not None else ""
        verdict = {True: "pass", False: "MISS", None: ""}[f.get("pass")]
        rows.append((f["feature"], name, _fmt(f["value"]), f["unit"], target, verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, r in enumerate(rows):
        cells = (c.rjust(w) if j == 2 else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True)))
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    m = result["machine"]
    t = result["targets"]
    head = (f"prefixlab bench{' --quick' if result['quick'] else ''}: {m['cpu_model']}, "
            f"{m['cpus_usable']} CPUs, {m.get('isa') or '?'}, numpy {m['numpy']} "
            f"({m['blas'].get('name', '?')} {m['blas'].get('version', '')}, kernel "
            f"{m['blas_runtime'].get('core', '?')}, {m['blas_runtime'].get('threads', '?')} threads), "
            f"{m['timestamp']}")
    if result["model"].get("description"):
        head += f"\nmodel: {result['model'].get('name', '')}: {result['model']['description']}"
        lay = result["model"].get("layout") or {}
        if lay.get("seconds"):  # engine/cpu/weight_layout.py: which copy of the weights this machine reads
            ms = "; ".join(f"{k} {v * 1e3:.1f} ms" for k, v in lay["seconds"].items())
            head += f"\nweights read as: {lay['layout']} ({lay.get('source')}: {ms})"
        elif lay:
            head += f"\nweights read as: {lay.get('layout')} ({lay.get('source') or 'not measured'})"
        huge = (result["model"].get("pages") or {}).get("huge")
        if huge is not None:  # engine/cpu/weight_image.py settle_huge
            head += f"; {huge:.0%} in 2 MiB pages"
    tail = [f"targets: {t['passed']}/{t['checked']} met" + (f"; missed: {', '.join(t['missed'])}"
                                                            if t["missed"] else "")]
    peer = result["details"].get("peer")
    if peer is not None and not peer.get("available"):
        tail.append(f"peer: not measured ({peer.get('reason')})")
    peer_server = (result["details"].get("serve") or {}).get("llama_cpp")
    if isinstance(peer_server, dict) and peer_server.get("available") is False:
        tail.append(f"serve: llama.cpp's server not measured ({peer_server['reason']})")
    ui = result["details"].get("ui")
    if ui is not None and not ui.get("available"):
        tail.append(f"ui: not measured ({ui.get('reason')})")
    for name, err in result["errors"].items():
        tail.append(f"{name}: FAILED: {err}")
    if result["quick"]:
        tail.append("(--quick: small sizes; the figures are not comparable with the targets)")
    return "\n".join([head, ""] + lines + [""] + tail)


def write_json(result: dict, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1, allow_nan=False)
        fh.write("\n")


def main(argv: list[str] | None = None) -> int:
    """`python -m app.bench`: the same command without the rest of the CLI."""
    import engine
    engine.tune_process()
    p = argparse.ArgumentParser(prog="prefixlab bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
