"""`prefixlab bench`: every figure present, finite and self-consistent.

The quick bench runs every section (a Dask cluster, child processes: a minute and more); here one
small section goes through the real CLI (`bench --quick --only scheduler --json`) for the whole
result (figures, targets, machine, table), and the engine's sections, whose figures are ratios
of one another, are checked on their own on the session's model.

No timing assertions: the machine is shared and noisy. The checks are that each figure is
there with a sane value, that every ratio is the quotient of the same run's numbers, and
that each pass/fail agrees with its value and target.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from app import bench
from app.bench.cache import cache_figures
from app.bench.common import TARGETS, figure, ratio
from app.bench.engine import prefill_flops
from tests.conftest import bundled_model_is

PREFILL = ["prefill_tok_s", "prefill_gflop_s", "matmul_ref_gflop_s", "prefill_flops_fraction"]
DECODE = ["decode_tok_s", "decode_weight_gb_s", "mem_read_gb_s", "decode_bw_fraction", "batch_decode_tok_s",
          "batch_speedup"]
W8_STEPS = ["batch8_step_ratio", "w8_peak_rss_mb"]
CACHE = ["attach_us_per_page", "insert_us_per_page", "evict_us_per_page"]
SCHED = ["sched_wall_cached_s", "sched_wall_plain_s", "sched_wall_ratio", "ttft_alone_hit_s",
         "ttft_alone_miss_s", "ttft_hit_miss_ratio", "burst_ttft_hit_mean_s", "burst_ttft_miss_mean_s",
         "queue_wait_mean_s", "queue_wait_max_s",
         "plain_queue_wait_mean_s", "sched_wall_spec_s", "spec_speedup_one_stream"]
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


@pytest.fixture(scope="module")
def section_run(real_model, tmp_path_factory):
    """One `bench --quick --only scheduler --json` run through the real CLI, in this process, on
    the session's model (the bench's own load of the bundled model returns it)."""
    from app import cli
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    with pytest.MonkeyPatch.context() as mp:
        bundled_model_is(real_model, mp)
        assert cli.main(["bench", "--quick", "--only", "scheduler", "--json", str(out)]) == 0
    with open(out, encoding="utf-8") as fh:
        return json.load(fh)


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


def test_cache_section_alone_on_a_tiny_pool():
    figures, details = cache_figures(quick=True)
    assert details["cached_pages"] >= 10_000
    for name in CACHE:
        assert figures[name]["value"] > 0 and math.isfinite(figures[name]["value"])


# one section through the CLI --------------------------------------------------------------------
@pytest.mark.model
def test_bench_section_has_every_figure_finite_and_positive(section_run):
    assert section_run["errors"] == {}
    assert section_run["quick"] is True and section_run["sections_run"] == ["scheduler"]
    assert_finite_and_positive(section_run["figures"], SCHED)


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
def test_bench_table_lists_every_figure(section_run):
    table = bench.format_table(section_run)
    for name in section_run["figures"]:
        assert name in table
    assert "targets:" in table


# the other sections, one by one ------------------------------------------------------------------
@pytest.mark.model
def test_prefill_and_decode_ratios_come_from_the_same_run(real_model):
    from app.bench.engine import decode_figures, prefill_figures
    figures, d = prefill_figures(real_model, quick=True)
    assert_finite_and_positive(figures, PREFILL)
    assert_targets_attached(figures)
    f = {k: v["value"] for k, v in figures.items()}
    assert close(f["prefill_flops_fraction"], f["prefill_gflop_s"] / f["matmul_ref_gflop_s"])
    n = d["prompt_tokens"]
    assert close(f["prefill_gflop_s"], d["model_flops"]["total"] * f["prefill_tok_s"] / n / 1e9)
    assert close(f["prefill_tok_s"], n / min(d["prefill_s"]))

    figures, d = decode_figures(real_model, quick=True, run_batch=True)
    assert_finite_and_positive(figures, DECODE)
    assert_targets_attached(figures)
    f = {k: v["value"] for k, v in figures.items()}
    assert close(f["decode_bw_fraction"], f["decode_weight_gb_s"] / f["mem_read_gb_s"])
    assert close(f["decode_weight_gb_s"], f["decode_tok_s"] * real_model.weights.matmul_bytes() / 1e9)
    assert d["bandwidth_bytes"] >= 512 * 1024 ** 2
    assert close(f["batch_speedup"], f["batch_decode_tok_s"] / f["decode_tok_s"])


@pytest.mark.model
def test_w8_steps_section_divides_its_own_timelines_steps(real_model):
    from app.bench.w8_steps import w8_step_figures
    figures, w8 = w8_step_figures(real_model.path, None, quick=True)  # W8's own timeline, a child's
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
