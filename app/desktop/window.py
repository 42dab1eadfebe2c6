"""The desktop app: the main window and its controller, wired together.

`Desktop` connects the window's actions to the controller and the controller's signals to
the widgets that draw them. It also reads the editors (system prompt, prompt list) when an
action needs them, keeps the session (prompts and transcripts) in QSettings, and asks the
questions (a model switch while streams run, a path to export to).
"""

from __future__ import annotations

import json
import os

from PySide6.QtCore import QObject, QSettings

from engine import BUILTIN_MODELS
from ui.about import AboutDialog
from ui.main_window import MainWindow
from ui.settings_dialog import SettingsDialog

from .. import settings_table
from ..scenario import Scenario, bundled_scenarios, load_scenario
from ..system_info import about_versions
from ..watch.gui import install_watch_action
from .advisor_controller import AdvisorController
from .builtin_menu import ModelInstalls
from .controller import Controller
from .server_toggle import ServerToggle
from .settings import AppSettings, qsettings, recent_models
from .whatif_controller import WhatIfController

SESSION_KEY = "session/json"


class Desktop(QObject):
    """One main window with its controller; `window` and `controller` are public."""

    def __init__(self, model_path: str | None = None, autoload: bool = True, store: QSettings | None = None):
        super().__init__()
        self.store = store or qsettings()
        self.controller = c = Controller(self.store, self)
        self.server = ServerToggle(c, self)
        self.window = w = MainWindow(self.store)
        self._closed = False
        self._wire_actions()
        self._wire_controller()
        self.whatif = WhatIfController(
            w.whatif, lambda: w.ask_open_path("Open a trace", "", "Traces (*.jsonl *.json);;All (*)"),
            c.driver.save_trace, parent=self,
            ask_cost_path=lambda: w.ask_open_path("Open a step-cost file", "", "Step cost (*.json);;All (*)"),
            model_path=lambda: (c.model_info or {}).get("path"))
        c.trace_saved.connect(self.whatif.on_session_trace)
        c.model_loaded.connect(lambda _info: self.whatif.refresh_cost())  # the new model's calibration
        self.advisor = AdvisorController(
            w.advisor, lambda: w.ask_open_path("Open a chat log or a proxy recording", "",
                                               "Traces (*.jsonl);;All (*)"), self._tokenizer, parent=self)
        c.advice_of = lambda: self.advisor.advice
        self.server.changed.connect(
            lambda url: self.advisor.set_served(self.server.server.backend if url else None))
        self._fill_scenarios()
        w.set_recent_models(recent_models(self.store))
        self._installs = ModelInstalls(self)
        self._restore_session()
        w.show_state(c.ready, c.loading, c.running)
        w.prompt_pane.show_settings(c.settings.to_dict())
        if autoload:
            self.load_model(model_path)

    def _tokenizer(self):
        """The loaded model's tokenizer (the Advisor tokenizes with it), or None."""
        scheduler = self.controller.driver.engine.scheduler
        return scheduler.model.tokenizer if scheduler is not None else None

    # wiring -----------------------------------------------------------------------------
    def _wire_actions(self) -> None:
        w, c = self.window, self.controller
        w.act_open.triggered.connect(self.open_model_dialog)
        w.act_open_scenario.triggered.connect(self.open_scenario_dialog)
        w.act_export.triggered.connect(self.export_report)
        w.act_open_report.triggered.connect(self.open_report_dialog)
        w.act_run_all.triggered.connect(self.run_all)
        w.act_run_selected.triggered.connect(self.run_selected)
        w.act_stop_all.triggered.connect(c.stop_all)
        w.act_flush.triggered.connect(c.flush_cache)
        w.act_save_cache.triggered.connect(c.driver.save_cache)
        w.act_probe.triggered.connect(self.probe_selected)
        w.act_settings.triggered.connect(self.open_settings)
        w.act_server.toggled.connect(self.server.set_on)
        w.act_stop_all.triggered.connect(self.server.stop_all)
        w.act_about.triggered.connect(self.show_about)
        w.prompt_list.run_requested.connect(self.run_prompt)
        w.recent_menu.aboutToShow.connect(lambda: w.set_recent_models(recent_models(self.store)))
        w.recent_chosen.connect(self.open_model_path)
        w.builtin_chosen.connect(self.open_builtin)
        w.recent_cleared.connect(self._clear_recent)
        w.scenario_chosen.connect(self.load_scenario)
        w.file_dropped.connect(self.handle_dropped_file)
        w.closing.connect(self.shutdown)
        install_watch_action(w)

    def _wire_controller(self) -> None:
        w, c = self.window, self.controller
        c.model_loading.connect(w.show_loading)
        c.model_loaded.connect(w.show_model)
        c.model_failed.connect(w.model_bar.set_failed)
        c.model_checked.connect(self.open_model_path)
        c.state_changed.connect(w.show_state)
        c.settings_changed.connect(w.prompt_pane.show_settings)
        c.status.connect(w.show_status)
        c.error.connect(self._show_error)
        c.transcript_added.connect(self._add_card)
        c.turn_started.connect(lambda uid: self._card(uid).show_turn_started())
        c.turn_accepted.connect(lambda uid: self._card(uid).show_accepted())
        c.text_arrived.connect(lambda uid, text: self._card(uid).show_text(text))
        c.turn_live.connect(lambda uid, record: self._card(uid).update_live(record))
        c.turn_finished.connect(lambda uid: self._card(uid).show_finished())
        c.turn_refused.connect(lambda uid, why: self._card(uid).show_refused(why))
        c.request_finished.connect(w.requests_table.add_record)
        c.request_finished.connect(lambda _: w.served_view.set_report(self.server.friendliness()))
        self.server.changed.connect(w.show_server)
        c.stats.connect(w.show_stats)
        c.scheduler_reset.connect(w.charts.clear)
        c.kv_budget.connect(w.show_kv_budget)
        c.probe_ready.connect(w.cache_panel.show_probe)
        w.cache_panel.pin_requested.connect(c.driver.pin_chain)  # the engine pins; snapshots show it
        c.report_opened.connect(w.show_report)
        c.run_done.connect(self._save_session)
        c.run_done.connect(w.charts.settle)

    def _card(self, uid: str):
        return self.window.streams.card(uid)

    def _add_card(self, transcript) -> None:
        card = self.window.add_card(transcript)
        card.stop_clicked.connect(self.controller.stop_stream)
        card.run_clicked.connect(self.run_prompt)
        card.followup_submitted.connect(self.controller.send_followup)

    def _show_error(self, title: str, message: str) -> None:
        if not self._closed:
            self.window.show_error(title, message)

    # the model --------------------------------------------------------------------------
    def load_model(self, path: str | None) -> bool:
        """Load a model (None: the bundled one; a built-in name: installed first if need be); asks
        first if streams run."""
        if path in BUILTIN_MODELS and not os.path.exists(path):
            return self.open_builtin(path)
        c = self.controller
        if c.running:
            if not self.window.confirm("Switch model?",
                                       f"{c.running} stream(s) are still running. Stop them and "
                                       f"load {os.path.basename(path) if path else 'the bundled model'}?"):
                return False
            c.stop_all()
        c.load_model(path)
        return True

    def open_model_path(self, path: str) -> bool:
        return self.load_model(os.path.abspath(path))

    def open_builtin(self, name: str) -> bool:
        """Open a built-in model; one that is not installed is installed first, once the user agrees."""
        return self._installs.open(name)

    def open_model_dialog(self) -> None:
        recent = recent_models(self.store)
        path = self.window.ask_open_path("Open a GGUF model", os.path.dirname(recent[0]) if recent else "",
                                         "GGUF models (*.gguf);;All files (*)")
        if path:
            self.open_model_path(path)

    def _clear_recent(self) -> None:
        self.store.setValue("recent_models", [])
        self.store.sync()

    def handle_dropped_file(self, path: str) -> None:
        """A .gguf opens as the model; a .json loads as a scenario.

        While streams run, a dropped file is checked first: one that is no model shows its
        error and leaves the streams alone; only a real model asks to stop them.
        """
        if path.lower().endswith(".json"):
            self.load_scenario_file(path)
        elif self.controller.running:
            self.controller.check_model(path)
        else:
            self.open_model_path(path)

    # scenarios --------------------------------------------------------------------------
    def _fill_scenarios(self) -> None:
        try:
            scenarios, problem = bundled_scenarios(), ""
        except (OSError, ValueError) as e:
            scenarios, problem = [], str(e)
        self.window.set_scenarios([(s.name, s.description, s) for s in scenarios], problem)

    def load_scenario(self, sc: Scenario) -> None:
        """Put a scenario's system prompt and prompts in the editors (earlier transcripts stay)."""
        pane, c = self.window.prompt_pane, self.controller
        pane.set_system_prompt(sc.system)
        uids = pane.prompt_list.set_prompts(sc.prompts or sc.conversation[:1])
        c.book.scripts = {uids[0]: list(sc.conversation[1:])} if not sc.prompts else {}
        if sc.max_new_tokens != c.settings.max_new_tokens:
            s = AppSettings.from_dict({**c.settings.to_dict(), "max_new_tokens": sc.max_new_tokens})
            if not s.errors():
                c.apply_settings(s)
        turns = (f", a {len(sc.conversation)}-turn conversation" if sc.conversation
                 else f", {len(sc.prompts)} prompts")
        self.window.show_status(f"Scenario: {sc.name}{turns} — press Run all (Ctrl+Enter)", 8000)

    def load_scenario_file(self, path: str) -> None:
        try:
            self.load_scenario(load_scenario(path))
        except ValueError as e:
            self.controller.report_error("Could not load the scenario", str(e))

    def open_scenario_dialog(self) -> None:
        path = self.window.ask_open_path("Open a scenario", "", "Scenarios (*.json)")
        if path:
            self.load_scenario_file(path)

    # running ----------------------------------------------------------------------------
    def run_all(self) -> int:
        """Submit every prompt together, each as a new conversation; return how many."""
        pane = self.window.prompt_pane
        self.window.refresh_titles()
        return self.controller.run_all(pane.system_prompt(), pane.prompt_list.prompts())

    def run_selected(self) -> None:
        sel = self.window.prompt_list.selected()
        if sel is not None:
            self.run_prompt(sel[0])

    def run_prompt(self, uid: str) -> bool:
        """Run one prompt alone, as a new conversation."""
        pane = self.window.prompt_pane
        self.window.refresh_titles()
        if not self.controller.run_prompt(uid, pane.prompt_list.text_of(uid), pane.system_prompt()):
            return False
        self.window.streams.ensure_visible(uid)
        return True

    def probe_selected(self) -> bool:
        """Ask how far the selected prompt (else the first) would match the cache."""
        pl = self.window.prompt_list
        sel = pl.selected() or next(iter(pl.prompts()), None)
        return self.controller.probe(self.window.prompt_pane.system_prompt(), sel[1] if sel else None)

    # settings, reports, about ------------------------------------------------------------
    def settings_dialog(self) -> SettingsDialog:
        """The Settings dialog on the current settings, validated as AppSettings validates."""
        dlg = SettingsDialog(self.controller.settings.to_dict(), settings_table.rows(),
                             lambda values: AppSettings.from_dict(values).errors(), self.window)
        dlg.flush_requested.connect(self.controller.flush_cache)
        return dlg

    def open_settings(self) -> None:
        dlg = self.settings_dialog()
        if dlg.exec() and dlg.result_values is not None:
            self.controller.apply_settings(AppSettings.from_dict(dlg.result_values))

    def export_report(self) -> None:
        if self.controller.model_info is None:
            self.window.show_info("Export report", "Load a model and run some prompts first.")
            return
        path = self.window.ask_save_path("Export report", "prefixlab-report.html",
                                         "HTML report (*.html);;PDF report (*.pdf);;JSON data (*.json)")
        if path:
            self.controller.export_report(path, self.window.prompt_pane.system_prompt())

    def open_report_dialog(self) -> None:
        path = self.window.ask_open_path("Open report", "", "PrefixLab reports (*.json);;All (*)")
        if path:
            self.controller.open_report(path)

    def show_about(self) -> None:
        summary = self.window.model_bar.summary() if self.controller.model_info else ""
        AboutDialog(self.window, about_versions(), summary).exec()

    # the session ------------------------------------------------------------------------
    def _restore_session(self) -> None:
        raw = self.store.value(SESSION_KEY)
        if not raw:
            return
        try:
            data = json.loads(str(raw))
            self.window.prompt_pane.set_system_prompt(str(data.get("system", "")))
            self.window.prompt_list.set_prompts([(p[0], p[1]) for p in data.get("prompts", [])])
            self.controller.restore_transcripts(data)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            pass  # a damaged session is not worth an error at start-up

    def session_data(self) -> dict:
        """System prompt, prompts and every transcript (what the next start restores)."""
        w = self.window
        return self.controller.session_data(w.system_edit.toPlainText(), w.prompt_list.prompts(),
                                            w.streams.uids())

    def _save_session(self) -> None:
        self.store.setValue(SESSION_KEY, json.dumps(self.session_data()))

    def shutdown(self) -> None:
        """Save the layout and the session, stop the engine thread. Safe to call twice."""
        if self._closed:
            return
        self.window.save_layout()
        self.controller.flush_text()
        self._save_session()
        self.store.sync()
        self._closed = True
        self.whatif.close()
        self.advisor.close()
        self.server.shutdown()  # ends served streams and closes their connections first
        self.controller.shutdown()
