"""The guided tour, walked end to end in the real window (offscreen) on the bundled model: every
step's caption numbers equal what the engine says, and the page map, chains table and charts show it."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

import engine as dl  # noqa: E402
from app.desktop.tour import SEEN_KEY, STEPS, caption, maybe_start_tour, start_tour  # noqa: E402

pytestmark = pytest.mark.model
STEP_TIMEOUT_MS = 120_000


def page_counts(w) -> dict[str, int]:
    return w.cache_panel.page_map.counts_by_state()


def test_the_tour_walks_the_tutorial_on_the_engine(window, qtbot):
    d, w = window, window.window
    tour = start_tour(d)
    with qtbot.waitSignal(tour.step_shown, timeout=STEP_TIMEOUT_MS):
        pass
    eng = tour.runner.engine
    rows = eng.pool.page_rows
    pa, pb = eng.prompts[1], eng.prompts[2]
    seen = {}

    def step(name: str) -> dict:
        with qtbot.waitSignal(tour.step_shown, timeout=STEP_TIMEOUT_MS) as blocker:
            tour.panel.next_button.click()
        assert blocker.args == [name]
        f = tour.facts.get(name, {})
        assert tour.panel.caption.text() == caption(f or {"step": name})
        seen[name] = f
        return f

    assert tour.current == "intro" and "step 1 of 9" in tour.panel.heading.text()
    assert str(len(pa)) in tour.panel.caption.text() and str(len(pb)) in tour.panel.caption.text()

    f = step("prefill_a")  # A's pages fill, private to A
    s_a = eng.session(1)
    assert f["n_prompt"] == len(pa) == s_a.n_past
    assert f["pages"] == len(s_a.page_table) == -(-len(pa) // rows) == eng.pool.num_used_pages
    assert page_counts(w)["private"] == f["pages"] and w.tabs.currentWidget() is w.cache_panel

    f = step("donate_a")  # full pages only, now shared by A and the cache
    assert f["added"] == len(pa) // rows == dl.prefix_held_groups(eng.cache)
    assert f["tokens"] == f["added"] * rows
    assert page_counts(w)["shared"] == f["added"]
    assert page_counts(w)["private"] == f["pages_in_use"] - f["added"]
    assert f"<b>{f['added']}</b> full pages" in tour.panel.caption.text()

    f = step("release_a")  # the cache still holds them
    assert eng.pool.num_used_pages == f["held"] == seen["donate_a"]["added"]
    assert page_counts(w) == {"free": eng.pool.capacity - f["held"], "private": 0, "shared": 0,
                              "cached": f["held"]}

    f = step("attach_b")  # cached N of M: the shared prefix, whole pages, one token short at most
    common = next((i for i, (x, y) in enumerate(zip(pa, pb)) if x != y), min(len(pa), len(pb)))
    expect = min(common, len(pb) - 1, seen["donate_a"]["tokens"]) // rows * rows
    assert f["matched"] == expect == eng.session(2).n_past > 0
    assert f["n_prompt"] == len(pb) and f["matched_pages"] == expect // rows
    assert set(f["refcounts"].values()) == {2}
    assert all(eng.pool.refcount[p] == n for p, n in f["refcounts"].items())
    assert f"cached {f['matched']} of {f['n_prompt']}" in tour.panel.caption.text()
    parts = f["parts"]  # where B's tokens went, summing to its prompt: cached, the page it shares in part
    assert parts["cached"] == f["matched"] and sum(v for k, v in parts.items() if k != "disk") == len(pb)
    assert parts["rounding"] == f["diverged_at"] - f["matched"] and f["diverged_at"] <= common
    assert f"cached {f['matched']}" in tour.panel.caption.text().split("went:")[1]
    assert page_counts(w)["shared"] == f["matched_pages"]

    f = step("prefill_b")  # only the tail; the TTFT chart shows B beside its estimate
    assert f["tail"] == len(pb) - seen["attach_b"]["matched"]
    assert eng.record(2).n_prefilled == f["tail"] and eng.record(2).n_cached == seen["attach_b"]["matched"]
    assert w.tabs.currentWidget() is w.charts
    est_x, est_y = w.charts.series("ttft_no_cache")
    assert list(est_x) == [2] and est_y[0] == pytest.approx(f["seconds"] + f["n_prompt"] / eng.prefill_rate()
                                                            - f["tail"] / eng.prefill_rate())
    assert f["whole_estimate"] == pytest.approx(est_y[0])
    assert list(w.charts.series("ttft_miss")[0]) == [1]

    f = step("chains")  # the chain list and the held pages
    chains = dl.prefix_chain_list(eng.cache)
    assert [c["id"] for c in f["chains"]] == [c.id for c in chains] and len(chains) == 1
    assert f["chains"][0]["hits"] == 1 and f["chains"][0]["n_tokens"] == seen["donate_a"]["tokens"]
    assert f["held"] == list(dl.prefix_held_pages(eng.cache))
    assert f["shared"] == f["held"][:seen["attach_b"]["matched_pages"]]
    assert w.cache_panel.chains_table.visible_chain_order() == [chains[0].id]

    f = step("teardown")  # the pool empty
    assert f["released"] == seen["donate_a"]["added"]
    assert f["pages_in_use"] == 0 == eng.pool.num_used_pages
    assert page_counts(w)["free"] == eng.pool.capacity

    step("done")  # the prompts loaded, Run all one key away
    scenario = tour.scenario
    assert [t for _, t in w.prompt_list.prompts()] == scenario.prompts
    assert w.prompt_pane.system_prompt() == scenario.system
    assert tour.panel.run_button.isVisible() and w.act_run_all.isEnabled()
    assert "Ctrl+Enter" in tour.panel.run_button.text()
    assert list(seen) == list(STEPS[1:])
    w.act_run_all.trigger()  # the key: the tour closes and the scheduler runs the prompts
    assert not tour.active
    qtbot.waitUntil(lambda: len(d.controller.finished_records) == len(scenario.prompts) and
                    not d.controller.running, timeout=240_000)
    assert d.controller.last_error is None


def test_skip_closes_the_tour_and_leaves_the_window_as_it_was(window, qtbot):
    d, w = window, window.window
    tour = start_tour(d)
    with qtbot.waitSignal(tour.step_shown, timeout=STEP_TIMEOUT_MS):
        pass
    assert w.cache_panel.page_map.page_count == tour.runner.engine.pool.capacity  # the tour's pool
    tour.panel.skip_button.click()
    assert not tour.active and not tour.panel.isVisible()
    # The charts and the page map are the app's own again (its scheduler's, or empty before one).
    snap = d.controller.snapshot
    assert w.charts.row_count == (len(snap.timeline) if snap else 0)
    assert w.cache_panel.page_map.page_count == (len(snap.page_states) if snap else 0)


def test_the_first_start_opens_the_tour_and_only_the_first(open_desktop, qtbot):
    d = open_desktop()
    tour = maybe_start_tour(d)
    assert tour is not None and tour.active and d.store.value(SEEN_KEY) in (True, "true")
    assert d.window.act_tour.text().startswith("&Tour")
    tour.close()
    again = open_desktop()  # the next start, same settings
    assert maybe_start_tour(again) is None
    again.window.act_tour.trigger()  # Help -> Tour
    assert again.tour.active
    again.tour.close()


def test_each_step_shows_its_call_and_copy_as_python_reproduces_it(window, qtbot, tmp_path):
    """The panel shows the tutorial's call that made each step with its real return value
    (step 5: `dl.prefix_attach(cache, pool, s_b, p_b)  # -> 80`), A's and B's prompts with their
    shared part marked, and Copy as Python gives a script that prints the same numbers."""
    import subprocess
    import sys

    from PySide6.QtGui import QGuiApplication

    d = window
    tour = start_tour(d)
    with qtbot.waitSignal(tour.step_shown, timeout=STEP_TIMEOUT_MS):
        pass
    eng = tour.runner.engine
    panel = tour.panel
    assert panel.prompts.isVisible()
    assert eng.texts[1][:eng.shared_chars()].replace("\n", "⏎")[-20:] in panel.prompts.toPlainText()
    assert "background" in panel.prompts.toHtml()  # the shared part is marked
    assert f"len(p_a)  # -> {len(eng.prompts[1])}" in panel.code.text()
    window.window.resize(1280, 800)
    qtbot.wait(50)  # every call line shown whole: the label is as tall as its lines
    assert panel.code.height() >= panel.code.sizeHint().height(), (panel.code.height(), panel.code.sizeHint())
    for name in STEPS[1:5]:  # through attach_b, step 5
        with qtbot.waitSignal(tour.step_shown, timeout=STEP_TIMEOUT_MS):
            panel.next_button.click()
        assert tour.code_shown() == eng.code(name)
    assert tour.current == "attach_b" and "step 5 of" in panel.heading.text()
    matched = tour.facts["attach_b"]["matched"]
    assert matched == eng.session(2).n_past > 0
    assert f"dl.prefix_attach(cache, pool, s_b, p_b)  # -> {matched}" in panel.code.text().splitlines()
    assert panel.code.isVisible()
    for name in STEPS[5:-1]:  # to the teardown
        with qtbot.waitSignal(tour.step_shown, timeout=STEP_TIMEOUT_MS):
            panel.next_button.click()
        assert tour.code_shown() == eng.code(name)
    panel.copy_button.click()
    script = QGuiApplication.clipboard().text()
    assert script == tour.script() and script.startswith("import engine as dl")
    path = tmp_path / "tour.py"
    path.write_text(script)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    results = [r for _, _, r in eng.calls if r is not None]  # one printed line each, in order
    assert len(printed) == len(results)
    for line, r in zip(printed, results):
        if not isinstance(r, str):  # the chain list prints records, the tour words
            assert line == str(r), (line, r)
    assert str(matched) in printed
    tour.close()
