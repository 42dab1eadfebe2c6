"""The weight layout: measured once per machine, remembered with the image, one copy read."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import engine
from engine.api import create_kv_pool
from engine.block_manager import SeqSlots
from engine.cpu import blas_threads, shared_matmul, weight_image, weight_layout
from engine.cpu.weight_layout import one_row as one_row_of
from engine.cpu.weight_layout import winner
from engine.model import forward


def _logits(model, prompts):
    """Last-token logits of several fresh sessions in one forward pass."""
    pool = create_kv_pool(model, 16, 64)
    sessions, nxt = [], 0
    for p in prompts:
        need = -(-len(p) // 16)
        sessions.append(SeqSlots(page_table=list(range(nxt, nxt + need)), n_past=0))
        nxt += need
    return forward(model, pool, sessions, prompts)


@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (8, 1), (1, 20), (4, 9), (1, 80)])
def test_every_layout_computes_the_same_logits(real_model, shape):
    """A decode row, a batch of 3 or 8, a 20-token prefill (shared like decode rows), a mix and an
    80-token prefill (BLAS's own threads): the same logits whichever copy is read."""
    n_seq, n_tok = shape
    rng = np.random.default_rng(n_seq * 100 + n_tok)
    prompts = [rng.integers(1, 40000, size=n_tok).tolist() for _ in range(n_seq)]
    cpu = real_model.backend
    for kind in weight_layout.BLOCKS:
        assert set(cpu.block_copies[kind]) >= {"wqkv", "wo", "w_gate_up", "w_down", "output_t"}
    before, one_row = cpu.layout, cpu.one_row
    try:
        cpu.layout = "plain"
        plain = _logits(real_model, prompts)
        blocks = {}
        for kind in weight_layout.BLOCKS:
            cpu.layout = kind
            for form in weight_layout.ONE_ROW:  # one row as a pair and as a GEMV
                cpu.one_row = form
                blocks[kind, form] = _logits(real_model, prompts)
    finally:
        cpu.layout, cpu.one_row = before, one_row
    scale = np.abs(plain).max()
    for got in blocks.values():
        np.testing.assert_allclose(got, plain, rtol=0, atol=2e-4 * scale)
        assert (got.argmax(-1) == plain.argmax(-1)).all()


@pytest.mark.parametrize("kind", weight_layout.BLOCKS)
def test_the_backend_learns_which_matmul_follows_which_in_a_pass(real_model, kind):
    """No caller names the next matmul: after a pass each matmul knows the one that followed it,
    whose first blocks the helpers read ahead (layer by layer, then the head, which ends the pass)."""
    cpu, layers = real_model.backend, real_model.config.n_layers
    before = cpu.layout
    try:
        cpu.layout = kind
        _logits(real_model, [[5]])
        _logits(real_model, [[7]] * 3)
        order = [(n, i) for i in range(layers) for n in ("wqkv", "wo", "w_gate_up", "w_down")]
        sites = [cpu.site(n, i) for n, i in order] + [cpu.site("output_t")]
    finally:
        cpu.layout = before
    for site, after in zip(sites, sites[1:]):
        assert site.then is after.blocks and site.then_job == after.job
    assert sites[-1].then is None                  # a pass ends with the head: nothing read ahead


@pytest.mark.parametrize("kind", weight_layout.BLOCKS)
def test_a_tied_embedding_is_read_from_the_head_blocks(real_model, kind):
    w, cpu = real_model.weights, real_model.backend
    tokens = np.array([0, 1, 63, 64, 12345, w.output.shape[0] - 1])
    before = cpu.layout
    try:
        cpu.layout = kind
        np.testing.assert_array_equal(cpu.embed(tokens), w.token_embd[tokens])
    finally:
        cpu.layout = before


def test_the_winner_keeps_blocks_only_when_they_pay_for_the_burst_and_cost_one_stream_little():
    base = {"plain_1": 10.0, "plain_8": 30.0}
    assert winner({**base, "blocks_1": 10.5, "blocks_8": 20.0}) == "blocks"
    assert winner({**base, "blocks_1": 13.0, "blocks_8": 17.0}) == "blocks"  # the Xeon's trade
    assert winner({**base, "blocks_1": 15.0, "blocks_8": 17.0}) == "plain"   # one stream too slow
    assert winner({**base, "blocks_1": 9.0, "blocks_8": 28.0}) == "plain"    # the burst no faster
    fast_gemm = {"plain_1": 10.0, "plain_8": 12.0}                                  # together no cheaper
    assert winner({**fast_gemm, "blocks_1": 13.0, "blocks_8": 10.0}) == "plain"
    # one row over the blocks is judged in its faster form: a pair here, a GEMV there
    assert winner({**base, "blocks_1": 15.0, "blocks_1_gemv": 11.0, "blocks_8": 17.0}) == "blocks"


def test_of_two_kinds_of_blocks_the_winner_is_the_one_a_stream_and_a_burst_cost_least_together():
    base = {"plain_1": 10.0, "plain_8": 30.0, "blocks_1": 9.5, "blocks_1_gemv": 9.0, "blocks_8": 18.0}
    # the Xeon's trade: transposed, one row 4% slower and eight rows 8% faster
    xeon = {**base, "blocks_t_1": 12.0, "blocks_t_1_gemv": 9.4, "blocks_t_8": 16.5}
    assert winner(xeon) == "blocks_t" and one_row_of(xeon, "blocks_t") == "gemv"
    assert winner({**xeon, "blocks_t_8": 17.8}) == "blocks"  # the burst gains less than one row loses
    assert winner({**base, "blocks_t_1": 8.0, "blocks_t_8": 40.0}) == "blocks"
    # transposed blocks must pay for the burst against plain as the others must
    only_t = {"plain_1": 10.0, "plain_8": 30.0, "blocks_t_1": 15.0, "blocks_t_8": 17.0}
    assert winner(only_t) == "plain"


def test_one_row_reads_the_blocks_in_the_form_measured_faster_here():
    assert one_row_of({"blocks_1": 10.0, "blocks_1_gemv": 7.5}) == "gemv"   # the Xeon: GEMV 1.3x
    assert one_row_of({"blocks_1": 10.0, "blocks_1_gemv": 11.0}) == "pair"  # the EPYC's pair kernel
    assert one_row_of({"blocks_1": 10.0}) == "pair"                         # not measured
    assert one_row_of({"blocks_1": 10.0, "blocks_1_gemv": 7.5}, "blocks_t") == "pair"
    assert one_row_of({"blocks_t_1": 10.0, "blocks_t_1_gemv": 7.5}, "blocks_t") == "gemv"


@pytest.mark.skipif(not shared_matmul.SUPPORTED or blas_threads.usable_cores() < 2,
                    reason="no decode helper here")
def test_the_probe_reads_blocks_shared_with_the_helper_as_decode_does(monkeypatch):
    """Alone on one core the blocks read half as fast as the plain GEMV's threads: the probe
    must measure each layout with the threads and sharing a decode pass of it gets."""
    conftest_chooser = blas_threads.blas_threads()
    # conftest's OPENBLAS_NUM_THREADS=1 (and Dask's OMP_NUM_THREADS=1 once a cluster test ran) cap the
    # chooser at one thread: this test needs the cores a user's process gets
    monkeypatch.setattr(blas_threads, "_env_threads", lambda: None)
    monkeypatch.setattr(blas_threads, "_default", blas_threads.BlasThreads())
    seen = []
    real_blocks, real_plain = weight_layout.site_matmul, weight_layout.plain_matmul
    monkeypatch.setattr(weight_layout, "site_matmul", lambda x, site, one_row: seen.append(
        ("blocks_t" if site.transposed else "blocks", shared_matmul._parts, one_row))
        or real_blocks(x, site, one_row))
    monkeypatch.setattr(weight_layout, "plain_matmul", lambda x, w: seen.append(
        ("plain", blas_threads.blas_threads()._current)) or real_plain(x, w))
    w = np.random.default_rng(0).standard_normal((1, 64, 192), dtype=np.float32)
    copies = {kind: {"wqkv": weight_layout.to_blocks(w, kind)} for kind in weight_layout.BLOCKS}
    times = weight_layout.measure(weight_layout.probe_arrays({"wqkv": w}, copies))
    cores = blas_threads.blas_threads().max_threads
    blocks = {(kind, cores, form) for kind in weight_layout.BLOCKS for form in weight_layout.ONE_ROW}
    assert blocks | {("plain", cores)} == set(seen)
    want = {"plain_1", "plain_8", *(f"{k}_{s}" for k in weight_layout.BLOCKS for s in ("1", "8", "1_gemv"))}
    assert set(times) == want
    pool = shared_matmul._pool
    assert cores >= 2 and pool is not None and len(pool.ready(cores - 1)) == cores - 1
    conftest_chooser._current = None  # the next pass sets BLAS's threads again, as conftest's chooser says


def test_the_layout_is_measured_once_then_remembered_for_this_machine(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    plain = {"wqkv": rng.standard_normal((2, 64, 192), dtype=np.float32)}
    blocks = {"blocks": {"wqkv": weight_layout.to_blocks(plain["wqkv"])}}
    arrays = weight_layout.probe_arrays(plain, blocks)
    calls = []
    real_measure = weight_layout.measure
    monkeypatch.setattr(weight_layout, "measure", lambda a: calls.append(1) or real_measure(a))
    monkeypatch.delenv(weight_layout.ENV, raising=False)
    monkeypatch.setattr(weight_layout, "others_cores", lambda a, b: 0.0)  # a quiet machine
    first, rec = weight_layout.choose(str(tmp_path), arrays)
    assert rec["source"] == "measured" and rec["kept"]
    assert set(rec["seconds"]) == {"plain_1", "plain_8", "blocks_1", "blocks_8", "blocks_1_gemv"}
    assert first == winner(rec["seconds"]) and rec["one_row"] == one_row_of(rec["seconds"], first)
    again, rec2 = weight_layout.choose(str(tmp_path), arrays)
    assert (again, rec2["source"], len(calls)) == (first, "remembered", 1)
    saved = json.loads((tmp_path / weight_layout.LAYOUT_FILE).read_text())
    assert saved[weight_layout.machine_key()]["layout"] == first
    monkeypatch.setenv(weight_layout.ENV, "remeasure")  # on demand
    _, rec3 = weight_layout.choose(str(tmp_path), arrays)
    assert rec3["source"] == "measured" and len(calls) == 2
    monkeypatch.setenv(weight_layout.ENV, "blocks")
    assert weight_layout.choose(str(tmp_path), arrays)[0] == "blocks" and len(calls) == 2
    monkeypatch.setenv(weight_layout.ENV, "fastest")
    with pytest.raises(engine.ModelLoadError, match="PREFIXLAB_LAYOUT.*'fastest'"):
        weight_layout.choose(str(tmp_path), arrays)


def test_a_probe_on_a_busy_machine_serves_this_run_and_is_measured_again(tmp_path, monkeypatch):
    """Another process busy during the probe takes cores from the candidates (a build at first
    start made plain win 3x too slow for the burst), so that choice is not remembered."""
    plain = {"wqkv": np.random.default_rng(1).standard_normal((2, 64, 192), dtype=np.float32)}
    arrays = weight_layout.probe_arrays(plain, {"blocks": {"wqkv": weight_layout.to_blocks(plain["wqkv"])}})
    monkeypatch.delenv(weight_layout.ENV, raising=False)
    others = {"cores": 1.6}
    monkeypatch.setattr(weight_layout, "others_cores", lambda a, b: others["cores"])
    chosen, rec = weight_layout.choose(str(tmp_path), arrays)
    assert (rec["source"], rec["kept"], rec["others_cores"]) == ("measured", False, 1.6)
    assert chosen == winner(rec["seconds"])
    assert not (tmp_path / weight_layout.LAYOUT_FILE).exists()
    others["cores"] = 0.1                                        # the build is done
    assert weight_layout.choose(str(tmp_path), arrays)[1]["source"] == "measured"
    assert weight_layout.choose(str(tmp_path), arrays)[1]["source"] == "remembered"


_RSS_CHILD = textwrap.dedent("""
    import json, numpy as np, engine
    from tests.test_layout import _logits
    def rss():
        return int([ln for ln in open("/proc/self/status") if ln.startswith("VmRSS")][0].split()[1]) << 10
    m = engine.load_model()
    _logits(m, [[5]]); _logits(m, [[7]] * 8); _logits(m, [list(range(1, 40))])
    print(json.dumps({"layout": m.backend.layout, "rss": rss(), "weights": m.weights.matmul_bytes(),
                      "source": m.backend.layout_record.get("source")}))
""")


@pytest.mark.parametrize("forced", ["plain", "blocks", "blocks_t", "auto"])
def test_only_one_copy_of_the_weights_becomes_resident(forced, tmp_path):
    """Decode rows, a batch of 8 and a prefill all read one copy; the probe's loser is given back."""
    env = {**os.environ, weight_layout.ENV: forced, "PREFIXLAB_CACHE_DIR": os.environ["PREFIXLAB_CACHE_DIR"]}
    if forced == "auto":  # a machine the image has not met: measured now
        folder = weight_image.image_dir(engine.default_model_path())
        if os.path.exists(os.path.join(folder, weight_layout.LAYOUT_FILE)):
            os.unlink(os.path.join(folder, weight_layout.LAYOUT_FILE))
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if forced != "auto":
        assert got["layout"] == forced
    else:
        assert got["source"] == "measured"
    # one copy is ~540 MB; two would be ~1,080 MB. The rest of the process stays under 300 MB.
    assert got["rss"] < got["weights"] + (300 << 20), got
