"""`prefixlab calibrate`: time real passes of the loaded model on this machine and fit the twin's
step-cost model (docs/design.md §16).

The passes are the engine's own: the real `Scheduler`, with serve's prefix cache on, stepped on a
thread of its own as serve steps it while requests arrive from another, runs a few small
workloads (one prompt of each of several lengths, then 2, 4 and 8 streams decoding together,
then long prompts whose chunks share passes with decoding streams, then prompts that hit a
cached system prompt and prefill only their own tokens on top of it), and each `step()` is
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
import random
import threading
import time

import numpy as np

from engine.loop import EngineLoop, Job, Refused
from engine.scheduler import FinishEvent, ModelRunner, SchedulerSettings

from .stepcost import IDLE_GAP_S, TERMS, PassShapes, StepCost, StepShape, fit, prompt_shape
from .steplog import StepLogError, fit_log

# Each workload: (cached prefix tokens, [(own prompt tokens, answer tokens) of each request]),
# its requests arriving ARRIVAL_GAP_S apart. A prefix is first run alone (its pages then cached), so the
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
RUN_TIMEOUT_S = 600   # a workload that takes longer has hung


def cost_path(model_path: str) -> str:
    """Where the model's calibrated step cost lives: beside its weight image."""
    from engine.cpu.weight_image import cache_root, image_key
    return os.path.join(cache_root(), f"{image_key(model_path)}.step-cost.json")


class _TimedRunner(ModelRunner):
    """The model's pass, noting each pass's shape for the caller's timing."""

    shape: StepShape | None = None
    after_idle = True   # the loop says, before each step

    def __init__(self, model):
        super().__init__(model)
        self.shapes = PassShapes()

    def forward(self, batch):
        self.shape = self.shapes(batch, self.after_idle)
        return super().forward(batch)


ARRIVAL_GAP_S = 0.05   # a workload's requests arrive this far apart, as a burst reaches serve
IDLE_S = 0.3           # and the engine idles this long before each, as between a server's bursts


class _TimedLoop(EngineLoop):
    """serve's loop, each step timed whole (the scheduler's work included) with its pass's shape."""

    def __init__(self, model, runner: _TimedRunner):
        super().__init__(model, SchedulerSettings(), runner=runner)  # as serve runs it: the cache on
        self.runner = runner
        self.samples: list[tuple[StepShape, float]] = []
        self.groups: list[tuple[int, int]] = []   # each sample's (workload, run of it): stepcost.fit
        self.group = (0, 0)
        self.fitted = False
        self.last_end: float | None = None   # when the last pass ended

    def step(self):
        self.runner.shape, fitted = None, self.fitted
        t0 = time.perf_counter()
        # as a server's step log tells it (steplog.logged_passes)
        self.runner.after_idle = self.last_end is None or t0 - self.last_end >= IDLE_GAP_S
        super().step()
        seconds = time.perf_counter() - t0
        if self.runner.shape is not None:
            self.last_end = t0 + seconds
            if fitted:
                self.samples.append((self.runner.shape, seconds))
                self.groups.append(self.group)


def measure(model, log=None, workloads=WORKLOADS
            ) -> tuple[list[tuple[StepShape, float]], list[tuple[int, int]]]:
    """(shape, seconds) of every pass of `workloads` through the real scheduler (the first
    workload, the warm-up, left out; a cached prefix's own pass is fitted too), and each pass's
    (workload, run): the workload's first place in `workloads`, and this run's place.

    As in `serve`, the loop steps on a thread of its own and requests arrive from another, while
    passes run: each workload's requests come ARRIVAL_GAP_S apart, after the engine idled IDLE_S
    (docs/twin.md, section 4, says what that does and does not change)."""
    from ..scenario import sample_tokens
    loop = _TimedLoop(model, _TimedRunner(model))
    text = sample_tokens(model, 4096)
    served = 0
    stopping = threading.Event()
    thread = threading.Thread(target=loop.serve_forever, args=(stopping,), name="calibrate-engine",
                              daemon=True)
    thread.start()

    def run(requests: list[tuple[list[int], int]], fitted: bool, group: tuple[int, int]) -> None:
        left, done, refused = [len(requests)], threading.Event(), []

        def sink(event) -> None:
            if isinstance(event, Refused):
                refused.append(event.message)
            if isinstance(event, (Refused, FinishEvent)):
                left[0] -= 1
                if not left[0]:
                    done.set()
        time.sleep(IDLE_S)
        loop.fitted, loop.group = fitted, group   # the loop is idle: the last workload's passes are timed
        for i, (prompt, new) in enumerate(requests):
            if i:
                time.sleep(ARRIVAL_GAP_S)
            loop.submit(Job(dict(prompt=prompt, max_new_tokens=new, stop_ids=[]), sink))
        if not done.wait(RUN_TIMEOUT_S) or loop.step_error or refused:
            raise RuntimeError(f"calibrate: a workload did not finish: {refused[:1] or loop.step_error}")

    def fresh(n: int) -> list[int]:
        # the text repeats one passage, so a rotation alone can repeat a prompt: a first token no
        # earlier request had makes every prompt new to the cache (no hit by chance)
        nonlocal served
        served += 1
        start = (97 * served) % len(text)
        return ([served % model.config.vocab_size] + text[start:] + text[:start])[:n]

    try:
        for w, workload in enumerate(workloads):
            prefix_len, requests = workload
            group = (workloads.index(workload), w)
            prefix = fresh(prefix_len) if prefix_len else []
            if prefix:
                run([(prefix, 1)], w > 0, group)
            run([(prefix + fresh(n), new) for n, new in requests], w > 0, group)
            if log:
                about = f" after a cached prefix of {prefix_len}" if prefix_len else ""
                log(f"  workload {w}/{len(workloads) - 1}: {len(requests)} request(s) of {requests[0][0]} "
                    f"tokens{about}")
    finally:
        stopping.set()
        loop.wake()
        thread.join()
    return loop.samples, loop.groups


class ServerCalibration:
    """calibrate's workloads sent to a running `prefixlab serve --step-log STEP_LOG` at `url`, as
    `measure` runs them (streamed completions of token ids that run to their length,
    ARRIVAL_GAP_S apart after IDLE_S idle), a few at a time if the caller likes (the bench sends
    them between a trace's bursts); `fit` fits the passes the server logged while they ran."""

    def __init__(self, url: str, step_log: str):
        if not os.path.exists(step_log):
            raise StepLogError(f"{step_log}: no such step log (start the server with --step-log {step_log})")
        self.url, self.step_log = url, step_log
        # a seed of its own: a second calibration of the same server on the first one's prompts
        # would hit the pages they left cached and time hits' passes, not these workloads'
        self._rng, self._served, self._sent = random.Random(), 0, 0
        self.spans: list[tuple[int, int]] = []   # byte ranges of the step log the fitted passes lie in
        # and of each workload's passes, with its (workload, run) for stepcost.fit's standard errors
        self.groups: list[tuple[int, int, tuple[int, int]]] = []
        self._kinds: dict[str, int] = {}

    def _fresh(self, n: int) -> list[int]:  # a first id no earlier prompt had: no hit by chance
        from .twin import BLOCK_IDS
        self._served += 1
        low, high = BLOCK_IDS
        return [low + self._served % (high - low)] + [self._rng.randrange(low, high) for _ in range(n - 1)]

    def _run(self, requests: list[tuple[list[int], int]], marks: list[int] | None = None) -> None:
        from .against import send_requests
        time.sleep(IDLE_S)   # the passes before these are written: where they start in the log
        if marks is not None:
            marks.append(os.path.getsize(self.step_log))
        failed = [m.error for m in send_requests(self.url, [(ARRIVAL_GAP_S * i, p, n)
                                                             for i, (p, n) in enumerate(requests)])
                  if m.error]
        if failed:
            raise StepLogError(f"{self.url}: a calibration request failed: {failed[0]}")

    def send(self, workloads, fitted: bool = True, log=None) -> None:
        """Run `workloads` on the server, one after another; `fitted`: `fit` fits their passes."""
        time.sleep(IDLE_S)   # the last pass before them is written
        starts, kinds = [os.path.getsize(self.step_log)], []
        for prefix_len, requests in workloads:
            marks = starts if kinds else None
            kinds.append(self._kinds.setdefault(repr((prefix_len, requests)), len(self._kinds)))
            prefix = self._fresh(prefix_len) if prefix_len else []
            if prefix:
                self._run([(prefix, 1)], marks)
                marks = None
            self._run([(prefix + self._fresh(n), new) for n, new in requests], marks)
            self._sent += 1
            if log:
                log(f"  workload {self._sent} sent")
        time.sleep(IDLE_S)   # and their own last pass
        if fitted:
            end = os.path.getsize(self.step_log)
            self.spans.append((starts[0], end))
            self.groups += [(a, b, (kind, self._sent - len(kinds) + i))
                            for i, (a, b, kind) in enumerate(zip(starts, starts[1:] + [end], kinds))]

    def fit(self):
        """(cost, samples, the log's header) of the passes `send` ran with `fitted`."""
        return fit_log(self.step_log, spans=self.spans, groups=self.groups)


def calibrate_server(url: str, step_log: str, log=None, workloads=WORKLOADS):
    """Send `workloads` to a running `prefixlab serve --step-log STEP_LOG` at `url` and fit the
    passes the server logged meanwhile (the warm-up's left out): the cost of that server under
    its own front end. (cost, samples, the log's header)."""
    cal = ServerCalibration(url, step_log)
    cal.send(workloads[:1], fitted=False, log=log)
    cal.send(workloads[1:], log=log)
    return cal.fit()


def calibrate(model, log=None) -> tuple[StepCost, list[tuple[StepShape, float]]]:
    """Measure and fit; the cost names this machine and the model, and how the engine pads and
    tiles a prompt pass on it (stepcost.features)."""
    from engine.step_log import header
    samples, groups = measure(model, log)
    head = header(model)   # what a served step log says of the same engine
    cost = fit([s for s, _ in samples], [t for _, t in samples], groups=groups,
               prompt_pad_rows=head["prompt_pad_rows"], attention_tile=tuple(head["attention_tile"]),
               machine=head["machine"], model=head["model"],
               fit={"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return cost, samples


FORMULA = ("step seconds = c0 + c_prompt x [prompt rows] + c_prefill x prompt rows (padded)"
           " + c_decode x decode rows + c_ctx x decode context + c_prefill_ctx x prompt pairs"
           " + c_after_prompt x [a decode pass just after a prompt pass]"
           " + c_hit_after_idle x [a prompt pass on cached pages right after an idle moment]")


def report(cost: StepCost, samples: list[tuple[StepShape, float]]) -> str:
    """The fit, its inputs and each pass's error, as the command prints them."""
    lines = ["pass  prompt rows  (padded)  decode rows  decode ctx  prompt pairs  after  idle hit  "
             "measured ms  predicted ms  error"]
    for i, (s, t) in enumerate(samples):
        p = cost.predict(s)
        _, _, padded, _, _, pairs, after, idle_hit = cost.features(s)
        lines.append(f"{i:4d}  {s.prefill_rows:11d}  {padded:8.0f}  {s.decode_rows:11d}  "
                     f"{s.decode_context:10d}  {pairs:12.0f}  {after:5.0f}  {idle_hit:8.0f}  "
                     f"{t * 1e3:11.2f}  {p * 1e3:12.2f}  {(p - t) / t:+6.1%}")
    return "\n".join([*lines, "", FORMULA, fit_summary(cost)])


def fit_summary(cost: StepCost) -> str:
    """The coefficients, their errors and how well they fit (what `--quiet` prints)."""
    f = cost.fit
    tile = "x".join(map(str, cost.attention_tile)) if cost.attention_tile else "none"
    lines = ["  " + "  ".join(f"{n} {_ms(n, getattr(cost, n))}" for n in TERMS),
             f"  a prompt pass pads to {cost.prompt_pad_rows} rows; attention tiles {tile}; a pass's ms "
             f"over the fit's, p10 / p50 / p90: prompt passes {_quantiles(cost.extra_prompt_s)}, "
             f"the others {_quantiles(cost.extra_s)}; a pass's draw follows the one before it at "
             f"rho {cost.rho:.2f}",
             "  standard errors: " + "  ".join(f"{n} {_ms(n, cost.stderr.get(n, 0.0))}" for n in TERMS)
             + f" ({f.get('stderr_from', 'residuals')})"]
    if f.get("round_levels"):   # how steady the host was: its spread is in the standard errors
        lines.append("  the host's speed in each round of the workloads (its passes' median time over "
                     "the fit's): " + " / ".join(f"{v:.2f}" for v in f["round_levels"]))
    lines += [f"  {f['steps']} passes of {f['shapes']} shapes; relative error per shape (its median pass): "
              f"median {f['median_rel_error']:.1%}, p90 {f['p90_rel_error']:.1%}, "
              f"worst {f['max_rel_error']:.1%}; per single pass: median {f['pass_median_rel_error']:.1%}",
              f"  machine: {cost.machine}; model: {cost.model}"]
    return "\n".join(lines)


def _quantiles(extra_s: tuple[float, ...]) -> str:
    n = len(extra_s)
    if not n:
        return "not measured"
    return " / ".join(f"{extra_s[i] * 1e3:+.1f}" for i in (n // 10, n // 2, n * 9 // 10))


UNITS = {"c0": (1e3, "ms"), "c_prompt": (1e3, "ms"), "c_prefill": (1e3, "ms/row"),
         "c_decode": (1e3, "ms/row"), "c_ctx": (1e6, "us/position"), "c_prefill_ctx": (1e6, "us/pair"),
         "c_after_prompt": (1e3, "ms"), "c_hit_after_idle": (1e3, "ms")}


def _ms(term: str, seconds: float) -> str:
    scale, unit = UNITS[term]
    return f"{seconds * scale:.4g} {unit}"


def compare(kept: StepCost, new: StepCost) -> dict:
    """Two fits side by side: each term's difference in units of the two fits' combined standard
    error (sqrt(se1^2 + se2^2)), and the verdict, whether the difference of all the terms
    together lies within the noise of the two: its squared Mahalanobis distance under the sum of
    the two fits' covariances (a fit without one: its standard errors, the terms independent)
    under the chi-square 95 % point for as many terms (`_joint`). Per term, the largest of eight
    z's passes 2 in about a third of pairs of fits of one machine even when every standard error
    is right (1 - 0.954^8); and terms trade off (prefill rows against their pairs), which the
    covariance weighs and one term's z cannot (docs/twin.md, section 1)."""
    terms = {}
    for n in TERMS:
        a, b = getattr(kept, n), getattr(new, n)
        se = math.hypot(kept.stderr.get(n, 0.0), new.stderr.get(n, 0.0))
        z = (b - a) / se if se else (0.0 if a == b else None)   # None: no standard error to say
        terms[n] = {"kept": a, "new": b, "difference": b - a, "combined_stderr": se, "z": z}
    zs = [t["z"] for t in terms.values()]
    worst = None if None in zs else max(abs(z) for z in zs)
    distance, dof = _joint(kept, new)
    limit = CHI2_95[dof - 1] if dof else None
    # terms trade off against each other (prefill rows and their context), so the passes they
    # predict say more than any one term: the relative change of each typical pass's time
    moved = {name: (new.predict(s) - kept.predict(s)) / kept.predict(s) for name, s in TYPICAL.items()}
    return {"terms": terms, "max_abs_z": worst, "distance": distance, "terms_compared": dof,
            "distance_limit": limit, "within_noise": distance is not None and dof > 0 and distance < limit,
            "pass_change": moved, "max_abs_pass_change": max(abs(v) for v in moved.values()),
            "kept_when": kept.fit.get("when"), "new_when": new.fit.get("when"),
            "stderr_from": [c.fit.get("stderr_from", "residuals") for c in (kept, new)]}


# the chi-square distribution's 95 % point for 1-8 degrees of freedom (NIST/SEMATECH e-Handbook of
# Statistical Methods, section 1.3.6.7.4): a distance under it is within the noise
CHI2_95 = (3.841, 5.991, 7.815, 9.488, 11.070, 12.592, 14.067, 15.507)


def _covariance(cost: StepCost) -> np.ndarray:
    if cost.covariance:
        return np.array(cost.covariance, dtype=np.float64)
    return np.diag([cost.stderr.get(n, 0.0) ** 2 for n in TERMS])


def _joint(kept: StepCost, new: StepCost) -> tuple[float | None, int]:
    """(d' S^+ d, the rank of S): d the coefficients' difference, S the sum of the two fits'
    covariances, over the terms either fit has noise on; (None, 0) when a term differs and
    neither has any (no verdict). Under the noise alone the distance follows a chi-square with
    as many degrees of freedom as the rank."""
    d = np.array(new.coefficients()) - np.array(kept.coefficients())
    cov = _covariance(kept) + _covariance(new)
    noisy = np.diag(cov) > 0
    if np.any(d[~noisy] != 0):
        return None, 0
    d, cov = d[noisy], cov[np.ix_(noisy, noisy)]
    if not len(d):
        return 0.0, 0
    # each term scaled by its standard error first: the terms' units differ by 10^6
    scale = np.sqrt(np.diag(cov))
    corr = cov / np.outer(scale, scale)
    return float((d / scale) @ np.linalg.pinv(corr, rcond=1e-9, hermitian=True) @ (d / scale)), \
        int(np.linalg.matrix_rank(corr, tol=1e-9, hermitian=True))


# typical passes, by what they run: the change of their predicted time compares two fits
TYPICAL = {"one decode row at 200": StepShape(decode_rows=1, decode_context=201),
           "8 decode rows at 200": StepShape(decode_rows=8, decode_context=8 * 201),
           "64 prefill rows": prompt_shape(0, 64),
           "512 prefill rows": prompt_shape(0, 512)}


def comparison_report(cmp: dict) -> str:
    lines = [f"beside the kept fit (of {cmp['kept_when'] or 'unknown time'}):",
             "  term              kept               new                difference / standard error"]
    for n, t in cmp["terms"].items():
        z = "no standard error kept" if t["z"] is None else f"{t['z']:+.1f}"
        lines.append(f"  {n:16s}  {_ms(n, t['kept']):17s}  {_ms(n, t['new']):17s}  {z}")
    if cmp["distance"] is None:
        verdict = "  not judged within noise: a term differs and neither fit has its standard error"
    else:
        said = "within noise" if cmp["within_noise"] else "NOT within noise"
        verdict = (f"  {said}: all the terms together differ by a distance of {cmp['distance']:.1f} over "
                   f"{cmp['terms_compared']} terms (within noise: under {cmp['distance_limit'] or 0:g}, the "
                   f"chi-square's 95 % point); the largest one alone by {cmp['max_abs_z']:.1f} standard "
                   "errors")
    lines += [verdict,
              "  a typical pass's predicted time moved: "
              + ", ".join(f"{name} {v:+.1%}" for name, v in cmp["pass_change"].items())]
    return "\n".join(lines)


def add_parser(sub) -> None:
    from ..common_args import add_model_arg
    p = sub.add_parser("calibrate", help="time real passes of the model and fit the twin's step cost",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(p)
    p.add_argument("--from-log", metavar="STEPS.jsonl",
                   help="fit the passes a server logged (`prefixlab serve --step-log`) instead of timing the "
                        "model here: the cost of that server, under its own traffic and front end")
    p.add_argument("--url", metavar="URL",
                   help="with --from-log: first send calibrate's workloads to the server at URL (started "
                        "with --step-log that file), and fit the passes it logged meanwhile")
    p.add_argument("--out", metavar="FILE.json", help="write the fit here (default: beside the weight image)")
    p.add_argument("--quiet", action="store_true", help="print only the fit, not every pass")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.url and not args.from_log:
        raise SystemExit("prefixlab calibrate: --url needs --from-log, the server's --step-log file")
    if args.from_log:
        try:
            if args.url:
                print(f"sending calibrate's workloads to {args.url} ...", flush=True)
                say = None if args.quiet else lambda s: print(s, flush=True)
                cost, samples, head = calibrate_server(args.url, args.from_log, log=say)
            else:
                cost, samples, head = fit_log(args.from_log)
        except StepLogError as e:
            raise SystemExit(f"prefixlab calibrate: {e}") from None
        print(f"fitted {len(samples)} passes a server logged in {args.from_log}", flush=True)
        model_path = head.get("model_path", "")
    else:
        from ..common_args import load_model_or_exit
        m = load_model_or_exit(getattr(args, "model", None))
        print(f"calibrating the step cost of {os.path.basename(m.path)} on this machine ...", flush=True)
        cost, samples = calibrate(m, log=None if args.quiet else lambda s: print(s, flush=True))
        model_path = m.path
    print(fit_summary(cost) if args.quiet else report(cost, samples))
    if not args.out and not os.path.exists(model_path):
        raise SystemExit(f"prefixlab calibrate: the log names no model file here ({model_path!r}); "
                         "give --out")
    out = args.out or cost_path(model_path)
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
