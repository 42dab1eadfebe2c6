"""The Advisor tab's controller: a trace (or the proxy's live recording) in, the advice off the UI
thread, plain rows to `ui.advisor_panel.AdvisorPanel` (docs/design.md §14).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal

from engine.scheduler import FinishEvent

from ..advise.advisor import Tokenizers, advise
from ..advise.hints import hints
from ..advise.html import view_data
from ..advise.rules import RulesError, resolve_rules
from ..advise.traffic import read_traffic
from ..replay.trace import TraceError
from ..scenario import REPO_ROOT

EXAMPLE_TRACE = os.path.join(REPO_ROOT, "resources", "traces", "chat-timestamp.jsonl")


def served_record(job, finish) -> dict | None:
    """A request the app's server ran, as a trace line: its chat messages (else the token ids the
    engine ran), the engine's cached tokens where an upstream's would stand. None for a typed
    prompt (they share the loop)."""
    if not job.client or not job.prompt:
        return None
    r = finish.record
    arrival = time.time() - (time.perf_counter() - job.arrival)  # the job's clock is perf_counter
    key = job.request.namespace if job.request is not None else ""
    messages = job.chat_args.get("messages")
    body = {"messages": messages} if messages else {"prompt": list(job.prompt)}
    return {"timestamp": round(arrival * 1000, 3), "key": key, "body": body,
            "usage": {"prompt_tokens": r.n_prompt, "completion_tokens": r.n_gen,
                      "prompt_tokens_details": {"cached_tokens": r.n_cached}}}


class AdvisorController(QObject):
    """Load trace -> advice -> panel; the proxy on -> each recorded request -> fresh advice."""

    _advised = Signal(dict, str)
    _failed = Signal(str)
    _recorded = Signal()
    _served = Signal()

    def __init__(self, panel, ask_trace_path: Callable[[], str], tokenizer_of: Callable[[], object | None],
                 parent: QObject | None = None):
        super().__init__(parent)
        self.panel, self.ask_trace_path, self.tokenizer_of = panel, ask_trace_path, tokenizer_of
        self.advice: dict | None = None
        self.proxy = None
        self.busy = False
        self._again: tuple | None = None  # traffic recorded while busy: advise once more after
        self._tmp = tempfile.TemporaryDirectory(prefix="prefixlab-advisor-")
        panel.load_requested.connect(self.load_trace)
        panel.example_requested.connect(self.load_example)
        panel.proxy_requested.connect(self.set_proxy)
        self._advised.connect(self._on_advised)
        self._failed.connect(self._on_failed)
        self._recorded.connect(self._on_recorded)
        self._served.connect(self._on_served)
        self.served = None          # the Recorder of the app's server traffic while it serves
        self._backend = None        # the app's server (app.serve.server.Backend) while it serves

    def load_trace(self, path: str | None = None) -> None:
        """Advise on a trace file (asking for one when no path is given)."""
        path = path or self.ask_trace_path()
        if path:
            self._start(path, os.path.basename(path))

    def load_example(self) -> None:
        """Advise on the shipped example: a chat log whose system prompt starts with the time."""
        self._start(EXAMPLE_TRACE, "the example (resources/traces/chat-timestamp.jsonl)")

    def set_proxy(self, on: bool, upstream: str = "", port: int = 8001) -> None:
        """Start the recording proxy in front of `upstream` (its traffic advised live), or stop it."""
        from ..proxy.cli import Proxy
        from ..serve.runner import ServeError
        if not on:
            self._stop_proxy()
            self.panel.set_proxy(None)
            return
        try:
            record = os.path.join(self._tmp.name, f"proxy-{port}.jsonl")
            self.proxy = Proxy(upstream, port=port, record=record).start()
        except (ValueError, ServeError) as e:
            self.proxy = None
            self.panel.set_proxy(None)
            self.panel.show_error(f"cannot start the proxy: {e}")
            return
        self.proxy.recorder.observers.append(lambda _rec: self._recorded.emit())  # the HTTP thread
        self.panel.show_error(None)
        self._show_proxy()

    def set_served(self, backend) -> None:
        """Advise on the app's own server traffic, live, while `backend` (the app's server, whose
        watchers see every served job's events) serves; None: it stopped."""
        from ..proxy.record import Recorder
        if self._backend is not None and self._watch in self._backend.watchers:
            self._backend.watchers.remove(self._watch)
        self._backend = backend
        if backend is None:
            return
        path = os.path.join(self._tmp.name, "served.jsonl")
        if os.path.exists(path):
            os.remove(path)  # a new server: its own traffic
        self.served = Recorder(path)
        self.served.observers.append(lambda _rec: self._served.emit())  # the engine's thread
        backend.watchers.append(self._watch)

    @property
    def following_server(self) -> bool:
        """True while the app's server traffic is advised live."""
        return self._backend is not None

    def _watch(self, job, event) -> None:
        rec = served_record(job, event) if isinstance(event, FinishEvent) else None
        if rec is not None and self.served is not None:
            self.served.write(rec)

    def _on_served(self) -> None:
        if self.served is not None:
            self._start(self.served.path, "the server's traffic")

    def close(self) -> None:
        self.set_served(None)
        self._stop_proxy()
        self._tmp.cleanup()

    def _stop_proxy(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None

    def _show_proxy(self) -> None:
        p = self.proxy
        if p is not None:
            self.panel.set_proxy(f"Proxy on {p.url}/v1 -> {p.upstream}: {p.recorder.count:,} requests "
                                 f"recorded (point clients at OPENAI_BASE_URL={p.url}/v1)")

    def _on_recorded(self) -> None:
        self._show_proxy()
        if self.proxy is not None:
            self._start(self.proxy.recorder.path, "the proxy's traffic")

    def _start(self, path: str, name: str) -> None:
        if self.busy:
            self._again = (path, name)
            return
        tok = self.tokenizer_of()
        if tok is None:
            self.panel.show_error("load a model first: prompts are tokenized with its chat template")
            return
        self.busy = True
        self.panel.set_busy(True)
        threading.Thread(target=self._job, args=(path, name, tok), daemon=True, name="advisor").start()

    def _job(self, path: str, name: str, tok) -> None:
        try:
            skipped: list = []
            requests = read_traffic(path, skipped)
            rules, toks = resolve_rules(None), Tokenizers(tok)
            advice = advise(path, requests, rules, toks, skipped)
            advice["hints"] = hints(advice, rules, requests, toks.prompts)
        except (TraceError, RulesError, ValueError, OSError) as e:
            self._failed.emit(str(e))
            return
        self._advised.emit(advice, f"{name}: {advice['requests']:,} requests")

    def _on_advised(self, advice: dict, description: str) -> None:
        self.advice = advice
        data = view_data(advice)
        self.panel.show_error(None)
        self.panel.set_trace(description)
        names = [rs["rules"]["name"] for rs in advice["rule_sets"]]
        self.panel.set_totals(data["totals_head"], data["totals_rows"], data["tips"],
                              [advice.get("hints", {}).get(n, "") for n in names])
        self.panel.set_groups(data["groups"])
        self.panel.set_whatif(data["fix"], data["whatif_head"], data["whatif_rows"])
        self._done()

    def _on_failed(self, message: str) -> None:
        self.panel.show_error(message)
        self._done()

    def _done(self) -> None:
        self.busy = False
        self.panel.set_busy(False)
        again, self._again = self._again, None
        if again is not None:
            self._start(*again)
