"""`prefixlab run`: several prompts through the scheduler, without a window."""

from __future__ import annotations

import time

from engine.loop import EngineLoop
from engine.scheduler import FinishEvent, Scheduler, SubmitRefused
from engine.stream import MAX_NEW_TOKENS
from engine.token_parts import add_parts, describe_totals, zero_totals

from .cache_persist import persist_from_args
from .common_args import (
    add_model_arg,
    add_sampling_args,
    add_scheduler_args,
    load_model_or_exit,
    sampling_from_args,
    scheduler_settings_from_args,
)
from .scenario import load_scenario


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run prompts that share a system prompt through the scheduler")
    add_model_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a user prompt (repeat for several)")
    src.add_argument("--scenario", help="a scenario JSON file (see resources/scenarios)")
    p.add_argument("--system", default="", help="the shared system prompt")
    g = add_scheduler_args(p)
    g.add_argument("--namespace", default="", help="cache namespace of these requests")
    add_sampling_args(p)
    p.add_argument("--json", help="write the whole record (the JSON report) here")
    p.add_argument("--report", help="write a report: .html, .pdf, .json or .csv/.zip")
    p.add_argument("--trace", metavar="OUT.jsonl",
                   help="write the requests as a trace (docs/trace-schema.md)")
    p.add_argument("--redact", action="store_true",
                   help="with --trace: write block hashes only (the Mooncake form), no token ids")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.set_defaults(func=run, max_new=None)  # a scenario's own max_new_tokens applies unless given


def describe(r) -> str:
    """One line per finished request, e.g. `cached 48 of 67 prompt tokens, ttft 22 ms, 41 tok/s`."""
    ttft = f"{r.ttft_s * 1e3:.0f} ms" if r.ttft_s is not None else "-"
    rate = f"{r.decode_tps:.0f} tok/s" if r.decode_tps else "- tok/s"
    spec = f", drafts {r.spec_acceptance:.0%} accepted" if r.spec_acceptance is not None else ""
    return (f"#{r.id} [{r.finish_reason}] cached {r.n_cached} of {r.n_prompt} prompt tokens, "
            f"ttft {ttft}, {rate}, {r.n_gen} tokens{spec}  {r.preview[:40]!r}")


def summary(sch: Scheduler, wall_s: float) -> str:
    """The session in two lines: hits and savings, then where its prompt tokens went (§15)."""
    st = sch.stats()
    totals = zero_totals()
    for r in sch.records():
        if r.parts is not None:
            add_parts(totals, r.parts)
    return (f"{len(sch.records())} requests in {wall_s:.2f} s; hit rate {st.get('hit_rate', 0.0):.0%}; "
            f"prefill tokens saved {sch.prefill_saved} (computed {sch.prefill_computed}); "
            f"seconds saved {sch.seconds_saved():.2f} at {sch.prefill_rate():.0f} prefill tok/s\n"
            f"{describe_totals(totals)}")


def run(args) -> int:
    try:
        sampling = sampling_from_args(args)
        settings = scheduler_settings_from_args(args)
        scenario = load_scenario(args.scenario) if args.scenario else None
    except ValueError as e:
        raise SystemExit(f"prefixlab run: {e}") from None
    max_new = args.max_new if args.max_new is not None else (
        scenario.max_new_tokens if scenario else MAX_NEW_TOKENS)
    if max_new < 1:
        raise SystemExit("prefixlab run: --max-new must be >= 1")
    m = load_model_or_exit(getattr(args, "model", None))
    loop = EngineLoop(m, settings)  # the one loop the window and the server drive too
    sch = loop.scheduler
    persisted = persist_from_args(args, sch)  # --persist-cache: loaded before the first request
    system = scenario.system if scenario else args.system
    common = {"system": system, "sampling": sampling, "max_new_tokens": max_new, "namespace": args.namespace}

    def on_event(ev) -> None:
        if isinstance(ev, FinishEvent) and not args.quiet:
            print(describe(ev.record), flush=True)

    # the cache outlives the answers only when saved, reported or traced: else the last turns'
    # closing tokens (evaluated for later requests) are left undone, as the process ends
    keep = bool(persisted or args.json or args.report or args.trace)
    t0 = time.perf_counter()
    try:
        if scenario and scenario.conversation:
            for i, turn in enumerate(scenario.conversation):
                loop.submit_now(on_event, user=turn, conversation_id="scenario", **common)
                loop.run_until_done(settle=keep or i + 1 < len(scenario.conversation))
        else:
            for prompt in (scenario.prompts if scenario else args.prompt):
                loop.submit_now(on_event, user=prompt, **common)
            loop.run_until_done(settle=keep)
    except SubmitRefused as e:
        raise SystemExit(f"prefixlab run: request refused: {e}") from None
    except KeyboardInterrupt:
        loop.stop()
    print(summary(sch, time.perf_counter() - t0))
    if persisted:
        persisted.save()
    for path in filter(None, (args.json, args.report)):
        write_report(path, sch, m, system, sampling, scenario.name if scenario else "")
        print(f"wrote {path}")
    if args.trace:
        from .replay.record import save_session_trace
        from .replay.trace import TraceError
        try:
            n = save_session_trace(args.trace, sch, m.name, source="run", redact=args.redact)
        except TraceError as e:
            raise SystemExit(f"prefixlab run: {e}") from None
        print(f"wrote {args.trace}: {n} requests" + (" (redacted: block hashes only)" if args.redact else ""))
    return 0


def write_report(path: str, sch: Scheduler, m, system: str, sampling, title: str) -> None:
    from .report import ReportWriteError, build_report
    from .report.render import export_report
    report = build_report(sch, m, system, sampling, title=title)
    try:
        export_report(path, report)
    except (ReportWriteError, ValueError) as e:
        raise SystemExit(f"prefixlab run: {e}") from None
