"""`prefixlab bench`: every figure present, finite and self-consistent.

Every section of `bench --quick` is run once in this module, on the session's loaded model:
load, scheduler, ui, kv_events, replay, cluster and tiers in one run through the real CLI
(`bench --quick --only ... --json`, `section_run`: about 38 s; the cold and warm loads take 10 s,
the ui 8 s, the Dask cluster 6 s);
prefill, decode, batch (W8's steps) and cache by their own functions (module fixtures), as
the CLI would call them. What each test covers:

- cheap unit tests: `--only` parsing, a figure's verdict and the ratio guard, the prefill FLOP
  count, the cache section on a tiny pool (its figures finite, positive, with unit, feature and
  target), the ui section without the desktop (no figures, and why);
- `section_run`: no section failed; the load, scheduler, replay and cluster figures finite and
  positive; the ratios are the quotients of the same run's numbers (scheduler, spec decoding,
  TTFT hit/miss, peak RSS the max of cold and warm, the Dask cluster's figures equal the pool's);
  the targets summary; the scheduler's runs comparable and the load's cold/warm children read
  (not) from the weight image; the machine recorded; the window and headless give the same
  tokens (ui); kv_events counts every block event (`prefixlab watch`'s); the table lists every figure;
- every figure with a target in TARGETS (but --peer's and the w8 section's) is measured by one
  of the sections above, with its target and a verdict that agrees; the table lists all their
  figures;
- prefill/decode and W8's steps: their ratios come from the same run;
- the peer, w8 and serve sections (not in --quick) and the crash of a peer's child; the CPU's name.

No timing assertions: the machine is shared and noisy. The checks are that each figure is
there with a sane value, that every ratio is the quotient of the same run's numbers, and
that each pass/fail agrees with its value and target.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest

from app import bench
from app.bench.cache import cache_figures
from app.bench.common import PEER_TARGETS, TARGETS, W8_TARGETS, figure, ratio
from app.bench.engine import prefill_flops
from tests.conftest import bundled_model_is

PREFILL = ["prefill_tok_s", "prefill_gflop_s", "matmul_ref_gflop_s", "prefill_flops_fraction"]
DECODE = ["decode_tok_s", "decode_weight_gb_s", "mem_read_gb_s", "decode_bw_fraction", "batch_decode_tok_s",
          "batch_speedup"]
W8_STEPS = ["batch8_step_ratio", "w8_peak_rss_mb"]
LOAD = ["cold_load_s", "warm_load_s", "peak_rss_gb", "peak_rss_warm_gb", "peak_rss_cold_gb"]
CACHE = ["attach_us_per_page", "insert_us_per_page", "evict_us_per_page"]
SCHED = ["sched_wall_cached_s", "sched_wall_plain_s", "sched_wall_ratio", "ttft_alone_hit_s",
         "ttft_alone_miss_s", "ttft_hit_miss_ratio", "burst_ttft_hit_mean_s", "burst_ttft_miss_mean_s",
         "queue_wait_mean_s", "queue_wait_max_s",
         "plain_queue_wait_mean_s", "sched_wall_spec_s", "spec_speedup_one_stream"]
REPLAY = ["replay_one_config_s", "replay_10k_blocks_s", "replay_sweep_wall_s", "replay_sweep_core_share"]
CLUSTER = ["cluster_sweep_dask_s", "cluster_sweep_pool_s", "cluster_dask_matches_pool",
           "cluster_1m_peak_rss_gb"]
QUEUE_WAITS = {"queue_wait_mean_s", "queue_wait_max_s", "plain_queue_wait_mean_s"}


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def assert_finite_and_positive(figures: dict, names: list[str]) -> None:
    for name in names:
        assert name in figures, f"missing figure {name}"
        v = figures[name]["value"]
        assert isinstance(v, float) and math.isfinite(v), f"{name} = {v!r}"
        assert v >= 0 if name in QUEUE_WAITS else v > 0, f"{name} = {v!r}"
        assert figures[name]["unit"] and figures[name]["feature"]


def assert_targets_attached(figures: dict) -> None:
    """Each figure carries its target from TARGETS, if it has one, and a verdict that agrees."""
    for name, fig in figures.items():
        if name not in TARGETS:
            assert fig["target"] is None and fig["pass"] is None, name
            continue
        target, op = TARGETS[name]
        assert (fig["op"], fig["target"]) == (op, target), name
        assert fig["pass"] is (fig["value"] <= target if op == "<=" else fig["value"] >= target), name


# the quick bench's sections that run through the CLI here; the others run by their functions below
CLI_SECTIONS = "load,scheduler,ui,kv_events,replay,cluster,tiers"
FUNCTION_SECTIONS = ("prefill", "decode", "batch", "cache")


@pytest.fixture(scope="module")
def section_run(real_model, tmp_path_factory):
    """One `bench --quick --only CLI_SECTIONS --json` run through the real CLI, in this process,
    on the session's model (the bench's own load of the bundled model returns it; the load and ui
    sections' children load it from the weight image the load section writes)."""
    from app import cli
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    with pytest.MonkeyPatch.context() as mp:
        bundled_model_is(real_model, mp)
        assert cli.main(["bench", "--quick", "--only", CLI_SECTIONS, "--json", str(out)]) == 0
    with open(out, encoding="utf-8") as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def cache_section():
    return cache_figures(quick=True)


@pytest.fixture(scope="module")
def prefill_section(real_model):
    from app.bench.engine import prefill_figures
    return prefill_figures(real_model, quick=True)


@pytest.fixture(scope="module")
def decode_section(real_model):
    from app.bench.engine import decode_figures
    return decode_figures(real_model, quick=True, run_batch=True)


@pytest.fixture(scope="module")
def w8_steps_section(real_model):
    from app.bench.w8_steps import w8_step_figures
    return w8_step_figures(real_model.path, None, quick=True)  # W8's own timeline, a child's


# cheap unit tests -----------------------------------------------------------------------------
def test_parse_only_sections_and_aliases():
    assert bench.parse_only(None) == [s for s in bench.SECTIONS if s not in ("peer", "soak")]  # opt-in
    assert bench.parse_only("peer") == ["peer"] and bench.parse_only("soak") == ["soak"]
    assert "blas" not in bench.parse_only(None, quick=True)
    assert bench.parse_only("cache, prefill") == ["prefill", "cache"]
    assert bench.parse_only("engine") == ["prefill", "decode", "batch", "load"]
    assert bench.parse_only("blas", quick=True) == ["blas"]
    with pytest.raises(ValueError, match="unknown bench section 'nope'"):
        bench.parse_only("cache,nope")


def test_figure_pass_follows_target_and_ratio_guards():
    assert figure(0.6, "ratio", "x", 0.55, ">=")["pass"] is True
    assert figure(0.5, "ratio", "x", 0.55, ">=")["pass"] is False
    assert figure(2.0, "s", "x", 1.5, "<=")["pass"] is False
    assert figure(1.0, "s", "x")["pass"] is None
    assert figure(None, "s", "x", 1.0, "<=")["pass"] is None
    assert ratio(1.0, 0.0) is None and ratio(None, 2.0) is None and ratio(3.0, 2.0) == 1.5


def test_prefill_flops_counts_matmuls_causal_attention_and_one_logits_row(tiny_model):
    cfg, w = tiny_model.config, tiny_model.weights
    n = 5
    per_layer = (w.wqkv[0].size + w.wo[0].size + w.w_gate_up[0].size + w.w_down[0].size)
    f = prefill_flops(tiny_model, n)
    assert f["matmul"] == 2 * n * cfg.n_layers * per_layer
    # QK^T and PV over the causal triangle: query i sees i + 1 keys.
    causal_pairs = sum(i + 1 for i in range(n))
    assert f["attention"] == cfg.n_layers * 2 * 2 * cfg.n_heads * cfg.head_dim * causal_pairs
    assert f["logits"] == 2 * cfg.vocab_size * cfg.d_model
    assert f["total"] == f["matmul"] + f["attention"] + f["logits"]


def test_cache_section_alone_on_a_tiny_pool(cache_section):
    figures, details = cache_section
    assert details["cached_pages"] >= 10_000
    assert_finite_and_positive(figures, CACHE)
    assert_targets_attached(figures)


def test_ui_section_says_why_when_the_desktop_cannot_start(monkeypatch):
    from app.bench import ui
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("app.desktop") else find_spec(name, *a))
    figures, details = ui.ui_figures("model.gguf", True, None)
    assert figures == {} and details["available"] is False and "app/desktop/" in details["reason"]


# several sections through the CLI ---------------------------------------------------------------
@pytest.mark.model
def test_bench_section_has_every_figure_finite_and_positive(section_run):
    assert section_run["errors"] == {}
    assert section_run["quick"] is True and section_run["sections_run"] == bench.parse_only(CLI_SECTIONS)
    assert_finite_and_positive(section_run["figures"], LOAD + SCHED + REPLAY + CLUSTER)


@pytest.mark.model
def test_bench_section_ratios_come_from_the_same_run(section_run):
    f = {k: v["value"] for k, v in section_run["figures"].items()}
    sd = section_run["details"]["scheduler"]
    assert close(f["sched_wall_ratio"], f["sched_wall_cached_s"] / f["sched_wall_plain_s"])
    assert close(f["spec_speedup_one_stream"], sd["one"]["wall_s"] / sd["one_spec"]["wall_s"])
    assert sum(r["spec_drafted"] for r in sd["one"]["records"]) == 0   # the default drafts nothing
    drafted = sum(r["spec_drafted"] for r in sd["one_spec"]["records"])
    if drafted:
        accepted = sum(r["spec_accepted"] for r in sd["one_spec"]["records"])
        assert close(f["spec_acceptance"], accepted / drafted)
    assert close(f["sched_wall_cached_s"], sd["cached"]["wall_s"])
    assert close(f["ttft_hit_miss_ratio"], f["ttft_alone_hit_s"] / f["ttft_alone_miss_s"])
    assert sd["ttft_alone"]["hit_cached_tokens"] > 0  # the hit really reused the system prompt
    assert close(f["peak_rss_gb"], max(f["peak_rss_warm_gb"], f["peak_rss_cold_gb"]))
    assert f["cluster_dask_matches_pool"] == 1.0  # the Dask cluster's numbers equal the pool's
    assert section_run["details"]["cluster"]["big"]["requests"] > 0


@pytest.mark.model
def test_bench_targets_and_verdicts_agree(section_run):
    figs = section_run["figures"]
    assert_targets_attached(figs)
    assert {"sched_wall_ratio", "ttft_hit_miss_ratio"} <= {k for k, v in figs.items() if v["target"]}
    summary = section_run["targets"]
    assert summary["missed"] == [k for k, v in figs.items() if v["pass"] is False]
    assert summary["checked"] == sum(1 for v in figs.values() if v["target"] is not None)


@pytest.mark.model
def test_bench_scheduler_runs_are_comparable(section_run):
    sched = section_run["details"]["scheduler"]
    for run in ("cached", "plain", "spec", "one", "one_spec"):
        assert all(r["n_gen"] == sched["new_tokens"] for r in sched[run]["records"]), run
    assert sched["cached"]["n_hits"] > 0 and sched["cached"]["n_misses"] > 0
    assert sched["plain"]["n_hits"] == 0 and sched["plain"]["settings"]["max_streams"] == 1
    # the defaults (speculative decoding off) against the same with it on
    assert sched["cached"]["settings"]["max_streams"] == 8 and not sched["cached"]["settings"]["spec_enabled"]
    assert not sched["one"]["settings"]["spec_enabled"]
    assert all(sched[run]["settings"]["spec_enabled"] for run in ("spec", "one_spec"))
    assert {**sched["spec"]["settings"], "spec_enabled": False} == sched["cached"]["settings"]
    load = section_run["details"]["load"]
    assert load["cold"]["from_image"] is False and load["warm"]["from_image"] is True


@pytest.mark.model
def test_bench_records_the_machine(section_run):
    m = section_run["machine"]
    for key in ("timestamp", "cpu_model", "cpu_count", "numpy", "blas", "python", "versions"):
        assert m.get(key), key
    assert m["cpu_count"] >= 1 and m["blas"].get("name")
    # where it ran, so two hosts' figures compare: the vector ISA, the BLAS kernel and its threads
    assert "isa" in m and m["blas_runtime"].get("core") and m["blas_runtime"].get("threads")
    assert (m["isa"] or "?") in bench.format_table(section_run).splitlines()[0]
    assert section_run["model"]["n_params"] > 0 and section_run["model"]["matmul_bytes"] > 0


@pytest.mark.model
def test_bench_ui_window_and_headless_give_the_same_tokens(section_run):
    ui = section_run["details"]["ui"]
    assert ui["available"], ui.get("reason")  # the desktop is part of the project: always measured
    f = {k: v["value"] for k, v in section_run["figures"].items()}
    for name in ("ui_max_gap_ms", "ui_busy_max_gap_ms", "ui_app_headless_ratio", "ui_app_s", "ui_headless_s"):
        assert f[name] > 0 and math.isfinite(f[name]), name
    assert section_run["figures"]["ui_max_gap_ms"]["target"] == TARGETS["ui_max_gap_ms"][0]
    for load in ("idle", "busy"):  # the window and headless produced the same tokens, in the same rounds
        rounds = ui[load]
        assert [a["tokens"] for a in rounds["app"]] == [h["tokens"] for h in rounds["headless"]]
        assert rounds["app"][0]["tokens"] == ui["prompts"] * ui["new_tokens"]
        assert close(rounds["ratios"][0], rounds["app"][0]["wall_s"] / rounds["headless"][0]["wall_s"])
    assert close(f["ui_app_headless_ratio"], ui["idle"]["ratio"])


@pytest.mark.model
def test_bench_kv_events_section_counts_every_block_event(section_run):
    # `prefixlab watch`'s section, from the same run (it was a second kv_events_figures(quick=True))
    figures, d = section_run["figures"], section_run["details"]["kv_events"]
    assert d["sockets"]["batches"] == d["feed"]["batches"] and d["sockets"]["seq_gaps"] == 0
    assert d["sockets"]["block_events"] == d["decode_apply"]["block_events"] > d["feed"]["batches"]
    fig = figures["watch_block_events_per_s"]
    assert fig["target"] == 50_000 and fig["value"] > 0 and fig["pass"] == (fig["value"] >= 50_000)
    ui = d["ui"]  # the real watch window in a child process, fed at 5,000 block events/s
    assert ui["batches_applied"] == ui["batches_sent"] and ui["max_stall_ms"] > 0
    assert figures["watch_ui_stall_ms"]["value"] == ui["max_stall_ms"]


@pytest.mark.model
def test_bench_table_lists_every_figure(section_run):
    table = bench.format_table(section_run)
    for name in section_run["figures"]:
        assert name in table
    assert "targets:" in table


# every section of the quick bench together --------------------------------------------------------
@pytest.mark.model
def test_every_target_of_the_quick_bench_is_measured_with_its_verdict(section_run, prefill_section,
                                                                      decode_section, w8_steps_section,
                                                                      cache_section):
    # this module runs every section of `bench --quick`, each once
    assert {*section_run["sections_run"], *FUNCTION_SECTIONS} == set(bench.parse_only(None, quick=True))
    figs = {**section_run["figures"], **prefill_section[0], **decode_section[0], **w8_steps_section[0],
            **cache_section[0]}
    # the peer section runs only with --peer, the w8 section (whole processes) not with --quick
    measured = set(TARGETS) - set(PEER_TARGETS) - set(W8_TARGETS)
    assert measured == {k for k, v in figs.items() if v["target"] is not None}
    for name, (target, op) in ((k, TARGETS[k]) for k in measured):
        fig = figs[name]
        assert (fig["op"], fig["target"]) == (op, target), name
        expected = fig["value"] <= target if op == "<=" else fig["value"] >= target
        assert fig["pass"] is expected, name
    table = bench.format_table({**section_run, "figures": figs, "targets": bench.target_summary(figs)})
    for name in figs:
        assert name in table


# the other sections, one by one ------------------------------------------------------------------
@pytest.mark.model
def test_prefill_and_decode_ratios_come_from_the_same_run(real_model, prefill_section, decode_section):
    figures, d = prefill_section
    assert_finite_and_positive(figures, PREFILL)
    assert_targets_attached(figures)
    f = {k: v["value"] for k, v in figures.items()}
    assert close(f["prefill_flops_fraction"], f["prefill_gflop_s"] / f["matmul_ref_gflop_s"])
    n = d["prompt_tokens"]
    assert close(f["prefill_gflop_s"], d["model_flops"]["total"] * f["prefill_tok_s"] / n / 1e9)
    assert close(f["prefill_tok_s"], n / min(d["prefill_s"]))

    figures, d = decode_section
    assert_finite_and_positive(figures, DECODE)
    assert_targets_attached(figures)
    f = {k: v["value"] for k, v in figures.items()}
    assert close(f["decode_bw_fraction"], f["decode_weight_gb_s"] / f["mem_read_gb_s"])
    assert close(f["decode_weight_gb_s"], f["decode_tok_s"] * real_model.weights.matmul_bytes() / 1e9)
    assert d["bandwidth_bytes"] >= 512 * 1024 ** 2
    assert close(f["batch_speedup"], f["batch_decode_tok_s"] / f["decode_tok_s"])


@pytest.mark.model
def test_w8_steps_section_divides_its_own_timelines_steps(w8_steps_section):
    figures, w8 = w8_steps_section
    assert_finite_and_positive(figures, W8_STEPS)
    assert_targets_attached(figures)
    assert w8["steps_8"] and w8["steps_1"] and w8["from_image"]
    assert close(figures["batch8_step_ratio"]["value"], w8["median_step_8_s"] / w8["median_step_1_s"])


CRASH = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"


def test_a_peer_that_crashes_fails_its_section_with_the_signal_and_a_build_that_avoids_it(monkeypatch):
    from app.bench import common, llama_cpp
    with pytest.raises(RuntimeError, match="killed by SIGSEGV"):
        common.timed_child([sys.executable, "-c", CRASH])
    # llama.cpp's native build did this on a Sapphire Rapids VM (AMX): the bench must outlive it
    monkeypatch.setattr(llama_cpp, "timed_child", lambda cmd: common.timed_child([cmd[0], "-c", CRASH]))
    with pytest.raises(RuntimeError) as e:
        llama_cpp.run_child("/models/x.gguf", 8, 1, 2)
    assert "x.gguf" in str(e.value) and "SIGSEGV" in str(e.value) and "GGML_NATIVE=OFF" in str(e.value)


@pytest.mark.model
def test_peer_section_prints_every_ratio_against_llama_cpp(real_model, monkeypatch):
    from app.bench import peer
    monkeypatch.setattr(peer.llama_cpp, "version", lambda: None)
    figures, details = peer.peer_figures(real_model, quick=True)
    assert figures == {} and "llama_cpp is not importable" in details["reason"]
    monkeypatch.undo()
    pytest.importorskip("llama_cpp")
    figures, details = peer.peer_figures(real_model, quick=True)
    for name in ("peer_prefill_ratio", "peer_decode_ratio", "peer_batch8_ratio",
                 "llama_cpp_prefill_tok_s", "llama_cpp_decode_tok_s"):
        assert figures[name]["value"] > 0 and math.isfinite(figures[name]["value"]), name
    t = details["seconds"]
    ours = details["decode_tokens"] / min(t["our_single"])
    peer_decode = figures["llama_cpp_decode_tok_s"]["value"]
    assert close(figures["peer_decode_ratio"]["value"], ours / peer_decode)


@pytest.mark.model
def test_w8_section_times_whole_runs_idle_and_beside_busy_processes(real_model):
    from app.bench import w8
    with w8.busy_processes(2) as procs:
        assert all(p.poll() is None for p in procs)                # both spinning
    assert all(p.poll() is not None for p in procs)                # and gone afterwards
    figures, details = w8.w8_figures(real_model.path, quick=True)
    walls = details["walls"]
    assert len(walls["idle"]) == len(walls["first_token"]) == 1 and walls["busy1"] and walls["busy2"]
    assert close(figures["w8_wall_s"]["value"], min(walls["idle"]))
    for n, name in ((1, "w8_one_busy_ratio"), (2, "w8_two_busy_ratio")):
        assert close(figures[name]["value"], min(walls[f"busy{n}"]) / min(walls["idle"]))
        assert figures[name]["target"] == TARGETS[name][0] and figures[name]["pass"] is not None
    assert figures["w8_first_token_s"]["value"] > 0 and figures["w8_first_token_s"]["pass"] is not None


@pytest.mark.model
def test_serve_section_keeps_our_server_when_llama_cpps_cannot_start(real_model, monkeypatch):
    from app.bench import serve
    real = serve._measure

    def measure(cmd, *args):  # llama.cpp's server as it exits without its extras installed
        if "llama_cpp.server" in cmd:
            cmd = [sys.executable, "-c", "raise SystemExit(\"No module named 'sse_starlette'\")"]
        return real(cmd, *args)

    monkeypatch.setattr(serve, "_measure", measure)
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: object())
    figures, details = serve.serve_figures(real_model.path, True, real_model.tokenizer.eos_ids)
    assert figures["serve_w8_wall_s"]["value"] > 0 and "serve_w8_wall_ratio" not in figures
    assert details["llama_cpp"]["available"] is False and "sse_starlette" in details["llama_cpp"]["reason"]
    from app.bench.common import machine_info
    table = bench.format_table({"machine": machine_info(), "model": {}, "figures": figures, "errors": {},
                                "quick": True, "details": {"serve": details},
                                "targets": bench.target_summary(figures)})
    assert "llama.cpp's server not measured" in table and "llama-cpp-python[server]" in table


def test_the_cpu_is_named_with_its_family_and_model_where_a_vm_names_every_generation_alike(tmp_path):
    from engine.machine import cpu_model
    cpu = ("processor\t: {}\nvendor_id\t: AuthenticAMD\ncpu family\t: {}\nmodel\t\t: {}\n"
           "model name\t: AMD EPYC\n\n")
    zen5, zen4 = tmp_path / "zen5", tmp_path / "zen4"
    zen5.write_text(cpu.format(0, 26, 2) + cpu.format(1, 26, 2))
    zen4.write_text(cpu.format(0, 25, 17))
    assert cpu_model(str(zen5)) == "AMD EPYC (family 26, model 2)"
    assert cpu_model(str(zen4)) != cpu_model(str(zen5))  # the layout probe's record is kept per CPU
