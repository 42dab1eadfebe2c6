"""The What-if tab's controller: a trace in, a sweep off the UI thread, rows to the panel.

It owns no widget: it connects a `ui.whatif_panel.WhatIfPanel`'s signals to the
Qt-free data layer (`app.replay.whatif`, `app.replay.whatif_twin`) and runs each plan,
sweep or twin prediction on a background thread (the sweep itself fans out to
processes), handing results back through queued signals. Predict TTFT runs the twin at the
latest sweep's capacities with the step cost it shows (a file the user loaded, else the
calibration kept for the loaded model); Stop ends that between two requests.
The window gives it callables: one that asks the user for a trace file, one that asks
the engine to save the running session's trace (the engine's answer goes to
`on_session_trace`), one for a cost file, and one naming the loaded model's file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal

from ..replay import whatif, whatif_cluster, whatif_twin
from ..replay.stepcost import StepCost
from ..replay.trace import TraceError, open_trace

CALIBRATE_TIMEOUT_S = 600   # the fit takes seconds; a child stuck this long is killed and reported


class WhatIfController(QObject):
    """Trace -> plan -> knobs on the panel; Run -> sweep -> rows on the panel."""

    _planned = Signal(object, str)        # Plan, description
    _swept = Signal(list, object)       # rows, the knobs they were swept at
    _predicted = Signal(list)
    _calibrated = Signal()
    _cluster_swept = Signal(list)
    _progress = Signal(int, int)
    _failed = Signal(str)

    def __init__(self, panel, ask_trace_path: Callable[[], str],
                 request_session_trace: Callable[[str], None] | None = None,
                 workers: int | None = None, parent: QObject | None = None, service=None,
                 ask_cost_path: Callable[[], str] | None = None,
                 model_path: Callable[[], str | None] | None = None):
        super().__init__(parent)
        self.panel = panel
        self.ask_trace_path = ask_trace_path
        self.request_session_trace = request_session_trace
        self.ask_cost_path = ask_cost_path
        self.model_path = model_path or (lambda: None)
        self.workers = workers
        self.service = service  # the cluster's ServiceModel; None: this machine's measured rates
        self.plan: whatif.Plan | None = None
        self.busy = False
        self.cost: StepCost | None = None
        self.loaded_cost: tuple[StepCost, str] | None = None  # a file the user chose wins over the kept one
        self.swept: tuple[whatif.Plan, whatif.Knobs] | None = None  # the latest sweep's trace and knobs
        self._stop = threading.Event()
        self._tmp = tempfile.TemporaryDirectory(prefix="prefixlab-whatif-")
        panel.load_requested.connect(self.load_trace)
        panel.session_requested.connect(self.take_session)
        panel.run_requested.connect(self.run)
        panel.cluster_requested.connect(self.run_cluster)
        panel.cost_requested.connect(self.load_cost)
        panel.calibrate_requested.connect(self.calibrate)
        panel.predict_requested.connect(self.predict)
        panel.stop_requested.connect(self._stop.set)
        panel.session_button.setEnabled(request_session_trace is not None)
        self._planned.connect(self._on_planned)
        self._swept.connect(self._on_swept)
        self._predicted.connect(self._on_predicted)
        self._calibrated.connect(self._on_calibrated)
        self._cluster_swept.connect(self._on_cluster_swept)
        self._progress.connect(panel.set_progress)
        self._failed.connect(self._on_failed)
        self.refresh_cost()

    # asks -------------------------------------------------------------------------------
    def load_trace(self, path: str | None = None) -> None:
        """Open a trace file (asking for one when no path is given) and plan it."""
        path = path or self.ask_trace_path()
        if path:
            self._start(self._plan_job, path, os.path.basename(path))

    def take_session(self) -> None:
        """Ask the engine for the running session's trace; `session_trace_saved` plans it."""
        if self.request_session_trace is not None and not self.busy:
            self._set_busy(True)
            self.request_session_trace(os.path.join(self._tmp.name, "session.jsonl"))

    def on_session_trace(self, path: str, error: str) -> None:
        """The engine's answer to `request_session_trace`: plan the trace, or show why not."""
        if error:
            self._on_failed(error)
            return
        self._set_busy(False)
        self._start(self._plan_job, path, "this session")

    def load_cost(self, path: str | None = None) -> None:
        """Predict with this step-cost file (asking for one when no path is given) from now on."""
        path = path or (self.ask_cost_path() if self.ask_cost_path else "")
        if not path:
            return
        try:
            self.loaded_cost = (StepCost.load(path), path)
        except ValueError as e:
            self.panel.show_error(str(e))
            return
        self.panel.show_error(None)
        self.refresh_cost()

    def refresh_cost(self) -> None:
        """Pick the step cost (the loaded file, else the loaded model's calibration) and say which."""
        model = self.model_path()
        try:
            cost, where = self.loaded_cost or whatif_twin.kept_cost(model)
        except ValueError as e:  # a kept file that no longer reads: say so, predict nothing
            cost, where = None, str(e)
        self.cost = cost
        self.panel.set_cost(whatif_twin.cost_text(cost, where) if cost else where, cost is not None,
                            bool(model))

    def calibrate(self) -> None:
        """`prefixlab calibrate` for the loaded model in a child process (its own copy of the weights,
        so the app's engine is not touched), then predict with the fit it keeps."""
        model = self.model_path()
        if model and not self.busy:
            self._start(self._calibrate_job, model)

    def run(self, page_rows: str, budgets: str, policies: list, disk_budgets: str = "") -> None:
        """Sweep the loaded trace at the knobs the panel shows (disk tiers: two-tier curves)."""
        self._sweep(self._sweep_job, whatif.knobs_from_text, page_rows, budgets, list(policies), disk_budgets)

    def predict(self, slo_ttft: str = "") -> None:
        """The twin's TTFT at the latest sweep's page sizes and capacities (goodput under the SLO)."""
        if self.swept is None or self.cost is None or self.busy:
            return
        try:
            slo = whatif_twin.parse_slo(slo_ttft)
        except ValueError as e:
            self.panel.show_error(str(e))
            return
        plan, knobs = self.swept
        configs = whatif_twin.configurations(knobs, plan.page_rows, plan.source.hashed)
        self._stop.clear()
        self._start(self._twin_job, plan, configs, self.cost, slo, stoppable=True)

    def run_cluster(self, replicas: str, budgets: str, routers: list) -> None:
        """Replay the loaded trace over clusters of replicas behind routers (docs/design.md §13)."""
        parse = whatif_cluster.cluster_knobs_from_text
        self._sweep(self._cluster_job, parse, replicas, budgets, list(routers))

    def _sweep(self, job, parse, *fields) -> None:
        """Parse the panel's fields into knobs (or show why not) and run `job` on them."""
        if self.plan is None or self.busy:
            return
        try:
            knobs = parse(*fields)
        except ValueError as e:
            self.panel.show_error(str(e))
            return
        self._start(job, self.plan.source, knobs)

    def close(self) -> None:
        self._tmp.cleanup()

    # jobs (background threads) ---------------------------------------------------------
    def _start(self, job, *args, stoppable: bool = False) -> None:
        self._set_busy(True, stoppable)
        self.panel.show_error(None)
        threading.Thread(target=self._guard, args=(job, *args), daemon=True, name="whatif").start()

    def _guard(self, job, *args) -> None:
        try:
            job(*args)
        except (TraceError, ValueError, RuntimeError, OSError) as e:
            self._failed.emit(str(e))
        except whatif_twin.Cancelled:
            self._failed.emit("Stopped: the predicted TTFT is not drawn (Predict TTFT starts it again)")

    def _plan_job(self, path: str, name: str) -> None:
        plan = whatif.plan(open_trace(path))
        kind = (f"hash-id trace, {plan.page_rows}-token blocks" if plan.source.hashed
                else f"token trace, {plan.page_rows}-token pages")
        self._planned.emit(plan, f"{name}: {plan.requests:,} requests ({kind}); {plan.cached_pages:,} pages "
                                 f"cached at infinite capacity, hit ratio {plan.bound:.1%}")

    def _sweep_job(self, source, knobs) -> None:
        rows = whatif.run(source, knobs, workers=self.workers,
                          progress=lambda done, total: self._progress.emit(done, total))
        self._swept.emit(rows, knobs)

    def _twin_job(self, plan, configs, cost, slo_ttft_s) -> None:
        self._predicted.emit(whatif_twin.run(
            plan.source, configs, cost, plan.requests, slo_ttft_s,
            progress=lambda done, total: self._progress.emit(done, total), cancelled=self._stop.is_set))

    def _calibrate_job(self, model: str) -> None:
        cmd = [sys.executable, "-m", "app.cli", "calibrate", "--model", model, "--quiet"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=CALIBRATE_TIMEOUT_S,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"prefixlab calibrate took over {CALIBRATE_TIMEOUT_S} s: stopped") from None
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip()).splitlines()
            why = said[-1] if said else f"exit status {done.returncode}"
            raise RuntimeError(f"prefixlab calibrate failed: {why}")
        self._calibrated.emit()

    def _cluster_job(self, source, knobs) -> None:
        if self.service is None:
            from ..replay.rates import default_service
            self.service = default_service()[0]  # measured once per machine, then read back
        self._cluster_swept.emit(whatif_cluster.run_cluster(
            source, knobs, self.service, workers=self.workers,
            progress=lambda done, total: self._progress.emit(done, total)))

    # results (UI thread) ---------------------------------------------------------------
    def _on_planned(self, plan, description: str) -> None:
        self.plan = plan
        self._set_busy(False)
        self.panel.set_trace(description, page_size_applies=not plan.source.hashed)
        k = plan.knobs
        self.panel.set_knobs(k.page_rows, k.budgets, k.policies)

    def _on_swept(self, rows: list, knobs: whatif.Knobs) -> None:
        self._set_busy(False)
        self.swept = (self.plan, knobs)
        self.refresh_cost()  # a calibration made since the app started
        self.panel.set_rows(rows)

    def _on_calibrated(self) -> None:
        self._set_busy(False)
        self.loaded_cost = None  # the fresh calibration is what the user asked for
        self.refresh_cost()

    def _on_predicted(self, rows: list) -> None:
        self._set_busy(False)
        self.panel.set_ttft_rows(rows)

    def _on_cluster_swept(self, rows: list) -> None:
        self._set_busy(False)
        self.panel.set_cluster_rows(rows)

    def _on_failed(self, message: str) -> None:
        self._set_busy(False)
        self.panel.show_error(message)

    def _set_busy(self, busy: bool, stoppable: bool = False) -> None:
        self.busy = busy
        self.panel.set_busy(busy, stoppable)
        if not busy:
            self.panel.session_button.setEnabled(self.request_session_trace is not None)
