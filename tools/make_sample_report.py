"""Make docs/report-sample.html and docs/report-sample.pdf from the eight-questions scenario.

Usage: python3 tools/make_sample_report.py [--out-dir docs] [--max-new 48] [--json] [--from-json PATH]
Runs the bundled model on resources/scenarios/eight_questions.json (a minute or two on a laptop
CPU), or with --from-json re-renders a saved JSON report without running the model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import engine  # noqa: E402

engine.tune_process()

from app.report import build_report, load_report  # noqa: E402
from app.report.render import export_report  # noqa: E402
from app.scenario import SCENARIO_DIR, load_scenario  # noqa: E402
from engine.loop import EngineLoop  # noqa: E402
from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler import FinishEvent  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=os.path.join(ROOT, "docs"))
    p.add_argument("--scenario", default=os.path.join(SCENARIO_DIR, "eight_questions.json"))
    p.add_argument("--max-new", type=int, default=None, help="tokens per answer (default: the scenario's)")
    p.add_argument("--json", action="store_true", help="also write report-sample.json")
    p.add_argument("--from-json", help="re-render this JSON report instead of running the model")
    args = p.parse_args(argv)
    if args.from_json:
        write(load_report(args.from_json), args.out_dir, json_too=args.json)
        return 0

    scenario = load_scenario(args.scenario)
    max_new = args.max_new or scenario.max_new_tokens
    model = engine.load_model()
    loop = EngineLoop(model)
    sch = loop.scheduler
    sampling = SamplingParams()  # greedy: the sample is reproducible up to timings

    def progress(ev) -> None:
        if isinstance(ev, FinishEvent):
            r = ev.record
            print(f"#{r.id} cached {r.n_cached}/{r.n_prompt}, {r.n_gen} tokens: {r.preview}", flush=True)

    for q in scenario.prompts:
        loop.submit_now(progress, system=scenario.system, user=q, sampling=sampling, max_new_tokens=max_new)
    t0 = time.perf_counter()
    loop.run_until_done()
    print(f"ran {len(scenario.prompts)} prompts in {time.perf_counter() - t0:.1f} s")
    report = build_report(sch, model, scenario.system, sampling,
                          title=f"PrefixLab sample report: {scenario.name}")
    write(report, args.out_dir, json_too=args.json)
    return 0


def write(report, out_dir: str, json_too: bool) -> None:
    names = ["report-sample.html", "report-sample.pdf"] + (["report-sample.json"] if json_too else [])
    for name in names:
        for path in export_report(os.path.join(out_dir, name), report):
            print(f"wrote {path} ({os.path.getsize(path):,} bytes)")


if __name__ == "__main__":
    sys.exit(main())
