"""The desktop app's engine side (docs/design.md §7): plain Python, no Qt.

`DesktopEngine` holds the Model and drives the one engine loop (engine/loop.py) that owns the
Scheduler; nothing else touches them. It runs on the engine thread that `EngineDriver`
(engine_driver.py) owns, and is called only there, except `submit`, `cancel` and
`request_shutdown`, which are thread-safe. Prompts typed in the window and HTTP requests (the
Server toggle) enter the loop the same way, as `Job`s through its `submit`. What it has to say
goes out through two callables it is given: each step's job events, as one list of
(ticket, event) under the job's ticket (the one id a card's turn has from its submit to its
finish), and every other report, one typed object at a time (below, and a Snapshot copy at
most 4 times a second).
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import engine
from engine.loop import Accepted, EngineLoop, Job, StepFailed
from engine.scheduler import POOL_FIELDS, Scheduler
from engine.snapshot import SnapshotMaker

from ..model_info import model_info
from ..probe import probe_prompt
from ..report import build_report
from .blas_share import leave_core_for_ui
from .cache_keeper import CacheKeeper
from .settings import AppSettings

STATS_INTERVAL_S = 0.25       # a Snapshot at most 4 times a second: each costs both threads time
LOAD_POLL_S = 0.05            # a load in progress looks this often whether the app quits


# What the engine reports besides job events and Snapshots -------------------------------------
@dataclass(frozen=True)
class ModelLoaded:
    info: dict                # app.model_info.model_info(model)


@dataclass(frozen=True)
class LoadFailed:
    message: str


@dataclass(frozen=True)
class ModelChecked:
    path: str
    why: str                  # "" when it opens as a model, else why it does not


@dataclass(frozen=True)
class SchedulerReset:
    settings: dict            # a new Scheduler (new pool, empty cache): its settings


@dataclass(frozen=True)
class KvBudget:
    budget: dict              # the KV budget it runs under: AppSettings.kv_budget


@dataclass(frozen=True)
class RunFinished:
    pass


@dataclass(frozen=True)
class Failed:
    message: str              # an exception in a request or a step; the thread lives on


@dataclass(frozen=True)
class ProbeReady:
    result: dict              # app.probe.probe_prompt


@dataclass(frozen=True)
class CacheFlushed:
    pages: int


@dataclass(frozen=True)
class ReportReady:
    path: str
    report: object            # report data (built here, rendered in the UI thread)


@dataclass(frozen=True)
class TraceSaved:
    path: str
    why: str                  # "" when written, else why not


@dataclass(frozen=True)
class CacheNote:
    line: str                 # the kept cache loaded, saved, or refused and why


@dataclass
class Served(Accepted):
    """A served (HTTP) job the scheduler took: its card is labelled with the client and preview."""

    client: str = ""
    preview: str = ""


def failure(where: str, e: Exception) -> Failed:
    """An exception as the user reads it: where, what, and its last frames."""
    return Failed(f"{where}: {type(e).__name__}: {e}\n\n{traceback.format_exc(limit=6)}")


def guarded(fn):
    """Run a request; any exception becomes a `Failed` report, never a dead thread."""

    @functools.wraps(fn)
    def wrapper(self, *args):
        try:
            return fn(self, *args)
        except Exception as e:  # noqa: BLE001 - reported to the user, the thread lives on
            self.on_report(failure(fn.__name__, e))
            return None

    return wrapper


class DesktopEngine:
    """Holds the Model and the loop's Scheduler; steps the loop while there is work."""

    def __init__(self, on_events: Callable[[list], None], on_report: Callable[[object], None]):
        self.on_events = on_events         # one step's [(ticket, event), ...], in order
        self.on_report = on_report         # every other report (the classes above, a Snapshot)
        self.model = None
        self.loop = EngineLoop()
        self._events: list = []            # this step's (ticket, event)s, for `on_events`
        self._settings = AppSettings()
        self._pending_settings: AppSettings | None = None
        self._maker, self._maker_of = SnapshotMaker(), None
        self.keeper = CacheKeeper()        # "Keep the cache across restarts": its folder, once set
        self._last_stats = 0.0
        self.busy = False
        self.quitting = False

    @property
    def scheduler(self) -> Scheduler | None:
        return self.loop.scheduler

    # thread-safe ------------------------------------------------------------------------------
    def submit(self, chat_args: dict) -> int:
        """Hand a typed turn (`ChatFrontEnd.request` arguments) to the engine loop, the door
        HTTP requests use too; return its ticket. Its events come back under the ticket
        through `on_events`: `Accepted` or `Refused`, its tokens, its `FinishEvent`."""
        job = Job(dict(chat_args))
        job.sink = functools.partial(self.job_event, job)
        return self.loop.submit(job)

    def cancel(self, tickets) -> None:
        """Stop these jobs (typed or served) at the loop's next step."""
        for ticket in tickets:
            self.loop.cancel(ticket)

    def request_shutdown(self) -> None:
        """Stop stepping at once (and end a load's wait); `close` then finishes."""
        self.quitting = True

    # requests, on the engine thread -----------------------------------------------------------
    @guarded
    def load_model(self, path: str) -> None:
        """Load a GGUF (the bundled model for ""); on failure keep the current model.

        The load runs in a helper thread that this one joins in short slices, so a quit
        (`request_shutdown`) ends the wait at once instead of after a big GGUF's load; the
        abandoned load is a daemon thread.
        """
        if self.quitting:
            return
        self._stop_everything()
        result: dict = {}

        def work() -> None:
            try:
                result["model"] = engine.load_model(path or None)
            except BaseException as e:  # noqa: BLE001 - handed back to this thread
                result["error"] = e

        loader = threading.Thread(target=work, name="prefixlab-load", daemon=True)
        loader.start()
        while loader.is_alive():
            loader.join(LOAD_POLL_S)
            if self.quitting:
                return
        error, model = result.get("error"), result.get("model")
        if isinstance(error, engine.ModelLoadError):
            self.on_report(LoadFailed(str(error)))
            return
        if model is None:  # any broken file must leave the old model
            self.on_report(LoadFailed(f"{path or 'the bundled model'}: {type(error).__name__}: {error}"))
            return
        self.model = model
        note = self._new_scheduler()
        self.on_report(ModelLoaded(model_info(model)))
        if note:  # after "Loaded ...", so the window's status bar ends on it
            self.on_report(CacheNote(note))

    @guarded
    def check_model(self, path: str) -> None:
        """Whether `path` opens as a model (header, metadata and tensor table only: fast)."""
        from engine.gguf_loader import open_gguf

        try:
            open_gguf(path)
        except engine.ModelLoadError as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - any broken file is only a "no"
            why = f"{path}: {type(e).__name__}: {e}"
        else:
            why = ""
        self.on_report(ModelChecked(path, why))

    @guarded
    def apply_settings(self, values: dict) -> None:
        """New preferences: live ones now, pool ones (a new Scheduler) when idle."""
        new = AppSettings.from_dict(values)
        new.validate()
        self._settings = new
        s = self.scheduler
        if s is None:
            return
        live = new.scheduler_settings(self.model)  # the same budget as the running pool's
        if any(getattr(live, f) != getattr(s.settings, f) for f in POOL_FIELDS):
            if self.loop.has_work():  # a job typed just before waits in the inbox: let it run
                self._pending_settings = new
            else:
                self._note(self._new_scheduler())
            return
        if live != s.settings:
            s.update_settings(live)
            self.on_report(KvBudget(new.kv_budget(s)))
            self._emit_stats(force=True)

    @guarded
    def flush_cache(self) -> None:
        if self.scheduler is None:
            return
        n = self.scheduler.flush_cache()
        self.on_report(CacheFlushed(n))
        self._emit_stats(force=True)

    def set_cache_root(self, root: str) -> None:
        """Where kept caches live (one folder per model, page rows and dtype under it)."""
        self.keeper.root = root

    @guarded
    def save_cache(self) -> None:
        """Save the cache now (Run → Save the cache now), whether or not it is kept at quit."""
        if self.scheduler is None:
            self.on_report(CacheNote("Cache not saved: no model is loaded"))
            return
        self.on_report(CacheNote(self.keeper.save(self.scheduler)))

    @guarded
    def pin_chain(self, chain_id: int, pinned: bool) -> None:
        if self.scheduler is not None and chain_id in self.scheduler.cache.chains:
            self.scheduler.cache.pin(chain_id, pinned)
            self._emit_stats(force=True)

    @guarded
    def probe(self, request: dict) -> None:
        """How far a prompt (system + user) would match the cache, and where it differs."""
        if self.scheduler is None or self.model is None:
            return
        self.on_report(ProbeReady(probe_prompt(self.scheduler, request.get("system", ""),
                                            request.get("user", ""), request.get("namespace", ""))))

    @guarded
    def make_report(self, request: dict) -> None:
        """Build the session's report data here (it reads the scheduler); the UI thread renders it."""
        if self.scheduler is None or self.model is None:
            raise RuntimeError("no model is loaded, so there is nothing to report")
        report = build_report(self.scheduler, self.model, request.get("system", ""),
                              self._settings.sampling(), request.get("title", ""),
                              namespace=self._settings.namespace,
                              kv_budget=self._settings.kv_budget(self.scheduler)["line"])
        self.on_report(ReportReady(request["path"], report))

    def save_trace(self, path: str) -> None:
        """Write the session's ended requests as a trace (the What-if tab's "This session")."""
        from app.replay.record import save_session_trace
        try:
            if self.scheduler is None or self.model is None:
                raise RuntimeError("no model is loaded yet, so there is no session to replay")
            save_session_trace(path, self.scheduler, self.model.name)
        except Exception as e:  # noqa: BLE001 - the tab shows why; the thread lives on
            self.on_report(TraceSaved(path, str(e)))
            return
        self.on_report(TraceSaved(path, ""))

    def close(self) -> None:
        """Stop stepping and keep the cache when asked to (the app is quitting)."""
        self.quitting = True
        if self._settings.keep_cache and self.scheduler is not None:
            self.on_report(CacheNote(self.keeper.save(self.scheduler)))

    # stepping ---------------------------------------------------------------------------------
    def begin_run(self) -> bool:
        """A job or a cancel reached an idle loop: whether to start stepping (not when quitting)."""
        if self.quitting:
            return False
        leave_core_for_ui()
        self.busy = True
        return True

    def step(self) -> bool:
        """One loop step; whether to step again (False: the run is over, or the app quits)."""
        if self.quitting:
            return False
        try:
            self.loop.step()
        except StepFailed as e:  # the loop recovered (its jobs were refused); say so
            self.on_report(Failed(f"scheduler step: {e}"))
            self._after_recovery()
        except Exception as e:  # noqa: BLE001 - a broken step must not kill the thread
            self.on_report(failure("scheduler step", e))
        self._emit_events()
        if not self.loop.has_work():
            self._run_done()
            return False
        self._emit_stats()
        return True

    def job_event(self, job: Job, event) -> None:
        """A job's event (engine thread): a typed job's sink, and the served jobs' watcher while
        the app serves. A served job's `Accepted` comes as `Served`, which opens its card."""
        if job.client and isinstance(event, Accepted):
            self.busy = True
            event = Served(event.request_id, event.n_prompt, job.client,
                           self.scheduler.record(event.request_id).preview)
        self._events.append((job.ticket, event))

    def _emit_events(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self.on_events(events)

    def _run_done(self) -> None:
        self._emit_stats(force=True)
        if self.busy:
            self.busy = False
            if self._pending_settings is not None:
                self._pending_settings = None
                self._note(self._new_scheduler())
            self.on_report(RunFinished())

    def _stop_everything(self) -> None:
        """Cancel every request and reap them (finish events go out as `cancelled`)."""
        if not self.loop.has_work():
            return
        self.loop.stop()
        self._emit_events()
        self._run_done()

    def _after_recovery(self) -> None:
        """The loop may have started over on a fresh scheduler: the window follows it."""
        if self.scheduler is not None and self.scheduler is not self._maker_of:
            self._scheduler_changed()

    def _new_scheduler(self) -> str:
        """A new Scheduler (new pool); with the cache kept, the old one saved and the new one
        loaded before the first request. Returns the load's status line ("" when none)."""
        if self.model is None:
            return ""
        keep, old = self._settings.keep_cache, self.scheduler
        if keep and old is not None:  # a new pool or model: the old cache is kept, not lost
            self._note(self.keeper.save(old))
        self.loop.reset(self.model, self._settings.scheduler_settings(self.model))
        note = self.keeper.load(self.scheduler) if keep else ""
        self._scheduler_changed()
        return note

    def _note(self, line: str) -> None:
        if line:
            self.on_report(CacheNote(line))

    def _scheduler_changed(self) -> None:
        self._emit_events()  # the jobs the old scheduler refused as it went
        self._maker, self._maker_of = SnapshotMaker(), self.scheduler
        self.on_report(KvBudget(self._settings.kv_budget(self.scheduler)))
        self.on_report(SchedulerReset(self.scheduler.settings.to_dict()))
        self._emit_stats(force=True)

    def _emit_stats(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.scheduler is None or (not force and now - self._last_stats < STATS_INTERVAL_S):
            return
        self._last_stats = now
        self.on_report(self._maker.take(self.scheduler))
