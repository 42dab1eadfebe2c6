"""A server's own passes for the twin (docs/twin.md, section 1): `serve --step-log` writes what
each pass ran and its seconds (engine/step_log.py), `calibrate --from-log` fits them, `calibrate
--url` first sends the server calibrate's workloads. No timing is asserted: what each pass ran,
the file's form, the fit's algebra."""

from __future__ import annotations

import dataclasses
import json

import pytest

from app.replay.stepcost import IDLE_GAP_S, PassShapes, StepCost
from app.replay.steplog import fit_log, logged_passes, logged_passes_at
from engine.loop import Job
from engine.scheduler import FinishEvent, SchedulerSettings
from engine.step_log import FORMAT, StepLogError, StepLogLoop, read_step_log

HEADER = {"format": FORMAT, "version": 1, "prompt_pad_rows": 28, "attention_tile": [32, 128],
          "machine": "test", "model": "test.gguf (1 bytes)", "model_path": "/nowhere/test.gguf"}
V2 = {**HEADER, "version": 2}   # a pass's line holds its start too
COST = StepCost(c0=0.02, c_prompt=0.05, c_prefill=0.0015, c_decode=0.0008, c_ctx=6e-6, c_prefill_ctx=1.2e-6,
                c_after_prompt=0.002, prompt_pad_rows=28, attention_tile=(32, 128))


def row(decode, pieces, seconds) -> str:
    return json.dumps({"seconds": seconds, "decode": decode, "pieces": pieces}) + "\n"


def varied_passes() -> list[tuple[list, list]]:
    """(decode, pieces) of passes whose shapes vary every term: prompts of several lengths after
    several prefixes, each followed by decode passes of 1, 4 and 8 streams (the first two just
    after a prompt pass), and one pass mixing both."""
    out = []
    for n_past in (0, 64, 300):
        for rows in (5, 40, 200):
            out.append(([], [(n_past, rows)]))
            for streams, ctx in ((1, 50), (4, 400), (8, 120 + rows)):
                out.append(([(ctx, 1)] * streams, []))
    out.append(([(600, 1)] * 3, [(0, 30)]))
    return out


def with_costs(passes) -> list[tuple[list, list, float]]:
    shapes = PassShapes()
    return [(d, p, COST.predict(shapes.parts(d, p))) for d, p in passes]


def write_log(path, passes, header=HEADER) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(header) + "\n")
        fh.writelines(row(d, p, t) for d, p, t in passes)


def test_a_log_of_a_known_cost_fits_back_to_it_from_an_offset(tmp_path):
    path = tmp_path / "steps.jsonl"
    write_log(path, [([], [[0, 9]], 9.0)])   # before the offset: not fitted
    start = path.stat().st_size
    passes = with_costs(varied_passes())
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(row(d, p, t) for d, p, t in passes)
    cost, samples, head = fit_log(str(path), start)
    assert len(samples) == len(passes) and head["prompt_pad_rows"] == 28   # the header before `start`
    assert (cost.prompt_pad_rows, cost.attention_tile) == (28, (32, 128))
    for term in ("c0", "c_prompt", "c_prefill", "c_decode", "c_ctx", "c_prefill_ctx", "c_after_prompt"):
        assert getattr(cost, term) == pytest.approx(getattr(COST, term), rel=1e-6), term
    assert cost.fit["from"] == f"step log {path}"
    # after the offset the first pass is a prompt pass, then two decode passes just after it
    assert [s.after_prompt for s, _ in samples[:4]] == [False, True, True, False]
    assert [s.prefill_rows for s, _ in logged_passes(str(path))[0][1][:2]] == [9, 5]
    whole, _, _ = fit_log(str(path))   # from the start, the 9 s pass counts and the fit moves
    assert whole.c_prompt != pytest.approx(COST.c_prompt, rel=1e-3)


def test_a_version_2_log_tells_a_hit_right_after_an_idle_moment_by_its_start(tmp_path):
    """The varied passes twice: the first time each prompt pass starts after an idle half-second,
    the second time straight after the pass before it. A prompt pass on cached positions after an
    idle moment is a `hit_after_idle` pass and the fit recovers its term; a fresh prompt after one
    is not, nor is any pass of a version 1 log (it stamps no start)."""
    cost = dataclasses.replace(COST, c_hit_after_idle=0.03)
    shapes, now, lines, expected, unstamped = PassShapes(), 0.0, [], [], []
    for round_ in (1, 2):
        for decode, pieces in varied_passes():
            idle = round_ == 1 and bool(pieces)
            now += 0.5 if idle else IDLE_GAP_S / 100
            seconds = cost.predict(shapes.parts(decode, pieces, idle))
            lines.append(json.dumps({"seconds": seconds, "start": round(now, 6), "decode": decode,
                                     "pieces": pieces}) + "\n")
            expected.append(idle and any(n > 0 for n, _ in pieces))
            unstamped.append((decode, pieces, seconds))
            now += seconds
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps(V2) + "\n" + "".join(lines))
    got, samples, _ = fit_log(str(path))
    assert [s.hit_after_idle for s, _ in samples] == expected and sum(expected) == 6
    for term in ("c_hit_after_idle", "c_prompt", "c_prefill_ctx"):
        assert getattr(got, term) == pytest.approx(getattr(cost, term), rel=1e-6), term
    v1 = tmp_path / "v1.jsonl"
    write_log(v1, unstamped)
    assert not any(s.hit_after_idle for _, passes in logged_passes(str(v1)) for s, _ in passes)


@pytest.mark.parametrize("text, says", [
    ('{"seconds": 0.1}\n', "a pass before any header line"),
    (json.dumps(HEADER) + "\nnot json\n", "line 2: not JSON"),
    (json.dumps({**HEADER, "version": 9}) + "\n", "step log version 9"),
    (json.dumps(HEADER) + '\n{"seconds": 0.1, "decode": []}\n',
     "line 2: a pass needs seconds, start"),
    (json.dumps(V2) + "\n" + row([], [[0, 4]], 0.1), "line 2: a pass needs seconds, start"),
    (json.dumps(V2) + '\n{"seconds": 0.1, "start": -1, "decode": [], "pieces": [[0, 4]]}\n',
     "starts at >= 0 s"),
    (json.dumps(HEADER) + "\n" + row([], [[0, 4]], -1), "seconds > 0"),
    (json.dumps(HEADER) + "\n" + row([], [[0, -4]], 0.1), "rows >= 1"),
])
def test_a_bad_step_log_names_its_line(tmp_path, text, says):
    path = tmp_path / "steps.jsonl"
    path.write_text(text)
    with pytest.raises(StepLogError, match=says):
        read_step_log(str(path))


def test_too_few_shapes_or_two_servers_models_are_refused_by_name(tmp_path):
    path = tmp_path / "steps.jsonl"
    write_log(path, [([], [[0, 4]], 0.1), ([[5, 1]], [], 0.03)])
    with pytest.raises(StepLogError, match=f"{path}: fitting a step cost needs passes of at least 8"):
        fit_log(str(path))
    write_log(path, with_costs(varied_passes()), header={**HEADER, "model": "other.gguf"})
    with pytest.raises(StepLogError, match="servers of different models"):
        fit_log(str(path))


def test_the_loop_logs_what_each_pass_ran(tiny_model, tmp_path):
    path = tmp_path / "steps.jsonl"
    loop = StepLogLoop(str(path))
    loop.reset(tiny_model, SchedulerSettings(page_rows=16))
    ended = []
    for n in (20, 7):
        loop.submit(Job(dict(prompt=list(range(30, 30 + n)), max_new_tokens=4, stop_ids=[]),
                        lambda e: ended.append(e) if isinstance(e, FinishEvent) else None))
    while len(ended) < 2:
        loop.step()
    loop.stop()
    [(head, passes)] = read_step_log(str(path))
    assert head["prompt_pad_rows"] == tiny_model.backend.exact_rows and head["model_path"] == tiny_model.path
    _, decode, pieces, seconds, start = passes[0]
    assert decode == [] and sorted(pieces) == [(0, 7), (0, 20)] and seconds > 0
    # 4 tokens each, the first from the prefill: three passes of both streams, each one further on
    assert [sorted(d) for _, d, p, _, _ in passes[1:]] == [[(7, 1), (20, 1)], [(8, 1), (21, 1)],
                                                            [(9, 1), (22, 1)]]
    # each pass starts after the one before it has run (seconds from the header, to the microsecond)
    starts, took = [p[4] for p in passes], [p[3] for p in passes]
    assert 0 <= starts[0] and all(b >= a + t - 2e-6 for a, b, t in zip(starts, starts[1:], took))
    [(_, shapes)] = logged_passes(str(path))
    assert [s.after_prompt for s, _ in shapes] == [False, True, True, False]


def test_serve_refuses_an_unwritable_step_log_before_it_starts(tmp_path):
    from app.cli import main
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match=f"--step-log {blocker}/steps.jsonl: cannot write it"):
        main(["serve", "--port", "0", "--step-log", str(blocker / "steps.jsonl")])


def test_calibrate_url_needs_the_servers_log(tmp_path):
    from app.cli import main
    with pytest.raises(SystemExit, match="--url needs --from-log"):
        main(["calibrate", "--url", "http://127.0.0.1:9"])
    with pytest.raises(SystemExit, match="no such step log"):
        main(["calibrate", "--url", "http://127.0.0.1:9", "--from-log", str(tmp_path / "none.jsonl")])


def _unfitted(path, start=0, spans=None, groups=None):
    """fit_log's passes, not fitted (a few workloads give too few shapes for eight terms), each
    with the (workload, run) `groups` gives it (None: in none)."""
    runs = logged_passes_at(path, start, spans)
    return [(head, [(s, t, next((key for a, b, key in groups or () if a <= at < b), None))
                    for at, s, t in passes]) for head, passes in runs]


def test_calibrate_server_fits_what_the_server_logged_after_the_warm_up(tiny_model, tmp_path, monkeypatch):
    """Three small workloads sent over HTTP to a real server, the first the warm-up: what is
    fitted is every pass the log gained after the warm-up's (the fit itself is left out here:
    three workloads give too few shapes for seven terms)."""
    import app.replay.calibrate as calibrate
    from tests.serve_helpers import scheduler_on, start_server
    monkeypatch.setattr(calibrate, "fit_log", _unfitted)
    path = tmp_path / "steps.jsonl"
    workloads = ((0, [(12, 2)]), (0, [(40, 3)] * 2), (20, [(8, 2)] * 3))
    server = start_server(scheduler_on(tiny_model, page_rows=16), loop=StepLogLoop(str(path)))
    try:
        [(_, fitted)] = calibrate.calibrate_server(server.url, str(path), workloads=workloads)
    finally:
        server.stop()
    [(_, logged)] = logged_passes(str(path))
    warm_up = logged[:len(logged) - len(fitted)]
    assert [(s, t) for s, t, _ in fitted] == logged[len(warm_up):] and warm_up
    # each fitted pass is known by its workload and run (stepcost.fit's standard errors)
    assert [g for _, _, g in fitted] == sorted(g for _, _, g in fitted) and fitted[-1][2] == (2, 2)
    assert {g for _, _, g in fitted} == {(1, 1), (2, 2)}
    assert [s.pieces for s, _ in warm_up if s.prefill_rows] == [((0, 12),)]   # the warm-up's prompt
    assert fitted[0][0].pieces == ((0, 40),)
    # the cached prefix's own pass, then three prompts on its full page: each prefills the rest
    assert any(s.pieces and all(n == 16 for n, _ in s.pieces) for s, _, _ in fitted)


def test_a_server_calibrated_twice_or_in_pieces_fits_only_its_fresh_passes(tiny_model, tmp_path, monkeypatch):
    """A second calibration of the same server prefills its prompts whole (the first one's cached
    pages are no hit for it), and one sent in pieces with other traffic between them (the bench
    sends it between a trace's bursts) fits its own passes only."""
    import app.replay.calibrate as calibrate
    from app.replay.against import send_requests
    from tests.serve_helpers import scheduler_on, start_server
    monkeypatch.setattr(calibrate, "fit_log", _unfitted)
    monkeypatch.setattr(calibrate, "IDLE_S", 0.05)
    path = tmp_path / "steps.jsonl"
    workloads = ((0, [(12, 2)]), (0, [(40, 3)] * 2))
    server = start_server(scheduler_on(tiny_model, page_rows=16), loop=StepLogLoop(str(path)))
    try:
        calibrate.calibrate_server(server.url, str(path), workloads=workloads)
        [(_, again)] = calibrate.calibrate_server(server.url, str(path), workloads=workloads)
        cal = calibrate.ServerCalibration(server.url, str(path))
        cal.send(workloads[:1])
        send_requests(server.url, [(0.0, list(range(5, 35)), 2)])   # another client's request
        cal.send(workloads[1:])
        [(_, pieces)] = cal.fit()
    finally:
        server.stop()
    assert [s.pieces for s, _, _ in again if s.prefill_rows][0] == ((0, 40),)   # no hit on the first's pages
    prompts = [s.pieces for s, _, _ in pieces if s.prefill_rows]
    # sent in two pieces, another client's request between: every fitted pass is known by its
    # workload and run, in the order sent
    groups = [g for _, _, g in pieces]
    assert groups == sorted(groups) and set(groups) == {(0, 0), (1, 1)}
    assert prompts[0] == ((0, 12),) and ((0, 30),) not in prompts and ((0, 40),) in prompts
