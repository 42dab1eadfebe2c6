"""`prefixlab calibrate`: time real passes of the loaded model on this machine and fit the twin's
step-cost model (docs/design.md §16).

The passes are the engine's own: the real `Scheduler`, with serve's prefix cache on, runs a few
small workloads (one prompt of each of several lengths, then 2, 4 and 8 streams decoding
together, then long prompts whose chunks share passes with decoding streams, then prompts that
hit a cached system prompt and prefill only their own tokens on top of it), and each `step()` is
timed whole, so the fit includes the scheduler's own work around the forward pass, as `serve`
pays it. Answers run to their length (no stop token). Every workload runs REPEATS times, so each
pass shape is timed that often and enters the fit as its median. The fit is kept beside the
weight image as one versioned JSON file (`cost_path`); `prefixlab replay --twin` reads it unless
`--cost` names another.
"""

from __future__ import annotations

import argparse
import math
import os
import time

from engine.loop import EngineLoop
from engine.scheduler import ModelRunner, SchedulerSettings

from .stepcost import TERMS, StepCost, StepShape, fit, shape_of

# Each workload: (cached prefix tokens, [(own prompt tokens, answer tokens) of each request]),
# its requests submitted together. A prefix is first run alone (its pages then cached), so the
# requests after it attach it and prefill only their own tokens on top of it: the passes a
# prefix-cache hit runs, whose rows attend a context they did not compute (without them the
# prefill-context term is barely identified, and hits' prefills came out about 20 % slower than
# predicted; docs/twin.md section 4). All but the warm-up run REPEATS times, each time on text of
# its own (no hit between workloads), so each shape's median leaves out the odd pass another
# process slowed.
REPEATS = 3
WORKLOADS = (
    (0, [(24, 4)]),                                          # warm-up: not fitted
    *[(0, [(16, 3)]), (0, [(96, 3)]), (0, [(256, 3)]), (0, [(512, 3)]), (0, [(900, 12)]),
      (0, [(40, 14)] * 2), (0, [(40, 14)] * 4), (0, [(40, 14)] * 8),
      (0, [(300, 8)] * 4), (0, [(160, 10)] * 8),
      (128, [(48, 6)] * 6), (384, [(96, 6)] * 3), (640, [(32, 4)])] * REPEATS,
)
SAME_WITHIN_SE = 2.0   # two fits agree on a term when they differ by less than this many standard errors


def cost_path(model_path: str) -> str:
    """Where the model's calibrated step cost lives: beside its weight image."""
    from engine.cpu.weight_image import cache_root, image_key
    return os.path.join(cache_root(), f"{image_key(model_path)}.step-cost.json")


class _TimedRunner(ModelRunner):
    """The model's pass, noting each pass's shape for the caller's timing."""

    shape: StepShape | None = None

    def forward(self, batch):
        self.shape = shape_of(batch)
        return super().forward(batch)


def measure(model, log=None, workloads=WORKLOADS) -> list[tuple[StepShape, float]]:
    """(shape, seconds) of every pass of `workloads` through the real scheduler (the first
    workload, the warm-up, left out; a cached prefix's own pass is fitted too)."""
    from ..scenario import sample_tokens
    runner = _TimedRunner(model)
    loop = EngineLoop(model, SchedulerSettings(), runner=runner)  # as serve runs it: the cache on
    sched = loop.scheduler
    text = sample_tokens(model, 4096)
    samples: list[tuple[StepShape, float]] = []
    served = 0

    def run(requests: list[tuple[list[int], int]], fitted: bool) -> None:
        for prompt, new in requests:
            loop.submit_now(prompt=prompt, max_new_tokens=new, stop_ids=[])
        while sched.has_work():
            runner.shape = None
            t0 = time.perf_counter()
            loop.step()
            seconds = time.perf_counter() - t0
            if runner.shape is not None and fitted:
                samples.append((runner.shape, seconds))

    def fresh(n: int) -> list[int]:
        # the text repeats one passage, so a rotation alone can repeat a prompt: a first token no
        # earlier request had makes every prompt new to the cache (no hit by chance)
        nonlocal served
        served += 1
        start = (97 * served) % len(text)
        return ([served % model.config.vocab_size] + text[start:] + text[:start])[:n]

    for w, (prefix_len, requests) in enumerate(workloads):
        prefix = fresh(prefix_len) if prefix_len else []
        if prefix:
            run([(prefix, 1)], w > 0)
        run([(prefix + fresh(n), new) for n, new in requests], w > 0)
        if log:
            about = f" after a cached prefix of {prefix_len}" if prefix_len else ""
            log(f"  workload {w}/{len(workloads) - 1}: {len(requests)} request(s) of {requests[0][0]} "
                f"tokens{about}")
    return samples


def calibrate(model, log=None) -> tuple[StepCost, list[tuple[StepShape, float]]]:
    """Measure and fit; the cost names this machine and the model."""
    from engine.machine import cpu_model
    samples = measure(model, log)
    size = os.path.getsize(model.path) if os.path.exists(model.path) else 0
    cost = fit([s for s, _ in samples], [t for _, t in samples],
               machine=f"{cpu_model()}, {os.cpu_count()} cores",
               model=f"{os.path.basename(model.path)} ({size} bytes)",
               fit={"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return cost, samples


def report(cost: StepCost, samples: list[tuple[StepShape, float]]) -> str:
    """The fit, its inputs and each pass's error, as the command prints them."""
    lines = ["pass  prefill rows  decode rows  decode ctx  prefill ctx  measured ms  predicted ms  error"]
    for i, (s, t) in enumerate(samples):
        p = cost.predict(s)
        lines.append(f"{i:4d}  {s.prefill_rows:12d}  {s.decode_rows:11d}  {s.decode_context:10d}  "
                     f"{s.prefill_context:11d}  {t * 1e3:11.2f}  {p * 1e3:12.2f}  {(p - t) / t:+6.1%}")
    f = cost.fit
    lines += ["", "step seconds = c0 + c_prefill x prefill rows + c_decode x decode rows"
                  " + c_ctx x decode context + c_prefill_ctx x prefill context",
              f"  c0 {cost.c0 * 1e3:.4f} ms  c_prefill {cost.c_prefill * 1e3:.4f} ms/row  "
              f"c_decode {cost.c_decode * 1e3:.4f} ms/row  c_ctx {cost.c_ctx * 1e6:.4f} us/position  "
              f"c_prefill_ctx {cost.c_prefill_ctx * 1e6:.5f} us/pair",
              "  standard errors: " + "  ".join(f"{n} {_ms(n, cost.stderr.get(n, 0.0))}" for n in TERMS),
              f"  {f['steps']} passes of {f['shapes']} shapes; relative error per shape (its median pass): "
              f"median {f['median_rel_error']:.1%}, p90 {f['p90_rel_error']:.1%}, "
              f"worst {f['max_rel_error']:.1%}; per single pass: median {f['pass_median_rel_error']:.1%}",
              f"  machine: {cost.machine}; model: {cost.model}"]
    return "\n".join(lines)


UNITS = {"c0": (1e3, "ms"), "c_prefill": (1e3, "ms/row"), "c_decode": (1e3, "ms/row"),
         "c_ctx": (1e6, "us/position"), "c_prefill_ctx": (1e6, "us/pair")}


def _ms(term: str, seconds: float) -> str:
    scale, unit = UNITS[term]
    return f"{seconds * scale:.4g} {unit}"


def compare(kept: StepCost, new: StepCost) -> dict:
    """Each term of two fits side by side: the difference, in units of the two fits' combined
    standard error (sqrt(se1^2 + se2^2)), and whether they agree within SAME_WITHIN_SE."""
    terms = {}
    for n in TERMS:
        a, b = getattr(kept, n), getattr(new, n)
        se = math.hypot(kept.stderr.get(n, 0.0), new.stderr.get(n, 0.0))
        z = (b - a) / se if se else (0.0 if a == b else None)   # None: no standard error to say
        terms[n] = {"kept": a, "new": b, "difference": b - a, "combined_stderr": se, "z": z}
    zs = [t["z"] for t in terms.values()]
    worst = None if None in zs else max(abs(z) for z in zs)
    # terms trade off against each other (prefill rows and their context), so the passes they
    # predict say more than any one term: the relative change of each typical pass's time
    moved = {name: (new.predict(s) - kept.predict(s)) / kept.predict(s) for name, s in TYPICAL.items()}
    return {"terms": terms, "max_abs_z": worst, "within_noise": worst is not None and worst < SAME_WITHIN_SE,
            "pass_change": moved, "max_abs_pass_change": max(abs(v) for v in moved.values()),
            "kept_when": kept.fit.get("when"), "new_when": new.fit.get("when")}


# typical passes, by what they run: the change of their predicted time compares two fits
TYPICAL = {"one decode row at 200": StepShape(decode_rows=1, decode_context=201),
           "8 decode rows at 200": StepShape(decode_rows=8, decode_context=8 * 201),
           "64 prefill rows": StepShape(prefill_rows=64, prefill_context=64 * 65 // 2),
           "512 prefill rows": StepShape(prefill_rows=512, prefill_context=512 * 513 // 2)}


def comparison_report(cmp: dict) -> str:
    lines = [f"beside the kept fit (of {cmp['kept_when'] or 'unknown time'}):",
             "  term           kept               new                difference / standard error"]
    for n, t in cmp["terms"].items():
        z = "no standard error kept" if t["z"] is None else f"{t['z']:+.1f}"
        lines.append(f"  {n:13s}  {_ms(n, t['kept']):17s}  {_ms(n, t['new']):17s}  {z}")
    worst = cmp["max_abs_z"]
    verdict = ("  not judged within noise: a term differs and neither fit has its standard error"
               if worst is None else
               f"  {'within noise' if cmp['within_noise'] else 'NOT within noise'}: the largest difference "
               f"is {worst:.1f} standard errors (within noise: under {SAME_WITHIN_SE:g})")
    lines += [verdict,
              "  a typical pass's predicted time moved: "
              + ", ".join(f"{name} {v:+.1%}" for name, v in cmp["pass_change"].items())]
    return "\n".join(lines)


def add_parser(sub) -> None:
    from ..common_args import add_model_arg
    p = sub.add_parser("calibrate", help="time real passes of the model and fit the twin's step cost",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(p)
    p.add_argument("--out", metavar="FILE.json", help="write the fit here (default: beside the weight image)")
    p.add_argument("--quiet", action="store_true", help="print only the fit, not every pass")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..common_args import load_model_or_exit
    m = load_model_or_exit(getattr(args, "model", None))
    print(f"calibrating the step cost of {os.path.basename(m.path)} on this machine ...", flush=True)
    cost, samples = calibrate(m, log=None if args.quiet else lambda s: print(s, flush=True))
    text = report(cost, samples)
    print(text if not args.quiet else "\n".join(text.splitlines()[-5:]))
    out = args.out or cost_path(m.path)
    if os.path.exists(out):
        try:
            print(comparison_report(compare(StepCost.load(out), cost)))
        except ValueError as e:
            print(f"(the kept fit is not compared: {e})")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        cost.save(out)
    except OSError as e:
        raise SystemExit(f"prefixlab calibrate: cannot write {out}: {e}") from None
    print(f"wrote {out}")
    return 0
