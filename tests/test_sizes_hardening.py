"""Every size a person can type is bounded, with the flag and the bound named; traces are read in
bounded lines from regular files only; a bad line is skipped and counted; `kill` mid-write leaves
no temporary file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from app.cli import main
from app.replay.cluster import MAX_REPLICAS
from app.replay.synth import MAX_SYNTHESIZE
from app.replay.trace import MAX_HASH_IDS, MAX_LINE_BYTES, TraceError, open_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]}  # 512-token blocks
GOOD_1 = {**GOOD, "input_length": 2}  # the same at --block-size 1


def refused(capsys, argv: list[str]) -> str:
    """argparse's message for a refused option (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, words", [
    (["--synthesize", "1e12"], ["--synthesize", f"at most {MAX_SYNTHESIZE:,}", "'1e12'"]),
    (["--synthesize", "1000000000000"], ["--synthesize", f"at most {MAX_SYNTHESIZE:,}"]),
    (["--synthesize", "10000000000"], ["--synthesize", f"at most {MAX_SYNTHESIZE:,}"]),
    (["--replicas", "1000000000"], ["--replicas", f"at most {MAX_REPLICAS:,} replicas"]),
    (["--replicas", "2,1e9"], ["--replicas", f"at most {MAX_REPLICAS:,} replicas"]),
    (["--replicas", "2", "--slots", "1e9"], ["--slots", "at most 4,096"]),
    (["--disk-budget", "1e9"], ["--disk-budget", "at most 1,000,000"]),
    (["--workers", "100000"], ["--workers", "processes"]),
])
def test_replay_sizes_are_bounded_and_named(tmp_path, capsys, argv, words):
    err = refused(capsys, ["replay", str(tmp_path / "t.jsonl"), *argv])
    assert all(w in err for w in words), err


def test_synthesize_takes_1e6_as_a_count(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["replay", str(out), "--synthesize", "2e3"]) == 0
    assert sum(1 for _ in open(out)) == 2000


@pytest.mark.parametrize("command", ["serve", "run"])
def test_disk_tier_pages_are_bounded_and_named(capsys, command):
    err = refused(capsys, [command, "--disk-tier-pages", "1000000000"])
    assert "--disk-tier-pages" in err and "at most 1,000,000" in err, err
    err = refused(capsys, [command, "--disk-tier-pages", "1e9"])
    assert "--disk-tier-pages" in err


@pytest.mark.parametrize("argv, words", [
    (["--port", "70000"], ["--port", "at most 65,535"]),  # it listened on 70000 mod 65536
    (["--max-body-bytes", "1e12"], ["--max-body-bytes", "at most 268,435,456 bytes"]),
])
def test_serve_sizes_are_bounded_and_named(capsys, argv, words):
    err = refused(capsys, ["serve", *argv])
    assert all(w in err for w in words), err


# a child that runs one command and reports, last, how far its peak resident memory grew while
# it ran, in MB (the imports before it vary with what earlier tests left in the environment)
PEAK_OF = ("import resource, sys; from app.cli import main; import app.replay.cli, app.replay.simulate; "
           "peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024; before = peak(); "
           "rc = main(sys.argv[1:]); print(peak() - before, file=sys.stderr); sys.exit(rc)")


def test_a_79_mb_line_of_10m_hash_ids_is_skipped_in_bounded_memory(tmp_path):
    path = tmp_path / "huge.jsonl"
    n = 10_000_000
    good = GOOD_1
    with open(path, "w") as fh:
        fh.write(json.dumps(good) + "\n")
        fh.write(f'{{"timestamp": 1, "input_length": {n}, "output_length": 1, "hash_ids": [')
        fh.write(",".join(["1234567"] * n))
        fh.write("]}\n")
        fh.write(json.dumps({**good, "timestamp": 2}) + "\n")
    assert path.stat().st_size > 75_000_000
    run = subprocess.run([sys.executable, "-c", PEAK_OF, "replay", str(path), "--block-size", "1", "--quiet"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "skipped 1 bad line(s), e.g. line 2: the line is over 16 MiB" in run.stderr
    assert " 2  " in run.stdout.splitlines()[1]  # both good requests replayed
    # the line is read and dropped a MiB at a time, never parsed (it took 2.5 GB)
    assert int(run.stderr.split()[-1]) < 600
    with pytest.raises(SystemExit, match="line 2: the line is over 16 MiB"):
        main(["replay", str(path), "--block-size", "1", "--quiet", "--strict"])


def test_a_line_of_more_hash_ids_than_the_bound_is_refused_by_count(tmp_path):
    n = MAX_HASH_IDS + 1
    row = {"timestamp": 0, "input_length": n, "output_length": 1, "hash_ids": list(range(n))}
    assert len(json.dumps(row)) < MAX_LINE_BYTES
    path = tmp_path / "many.jsonl"
    path.write_text(json.dumps(GOOD_1) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TraceError, match=f"line 2: {n:,} hash_ids: at most {MAX_HASH_IDS:,} blocks"):
        list(open_trace(str(path), block_size=1))
    source = open_trace(str(path), block_size=1, strict=False)
    assert len(list(source)) == 1 and source.skipped.count == 1


@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "folder"])
def test_only_regular_files_are_read_as_traces(tmp_path, target):
    if target == "fifo":
        path = str(tmp_path / "pipe.jsonl")
        os.mkfifo(path)  # opening it would wait for a writer for ever
    elif target == "folder":
        path = str(tmp_path)
    else:
        link = tmp_path / "zero.jsonl"
        link.symlink_to("/dev/zero")
        path = target if target.startswith("/") else str(link)
    t0 = time.perf_counter()
    with pytest.raises(SystemExit, match="not a regular file"):
        main(["replay", path, "--quiet"])
    with pytest.raises(SystemExit, match="not a regular file"):
        main(["advise", path])
    assert time.perf_counter() - t0 < 10


def test_a_symlink_to_dev_zero_is_refused(tmp_path):
    link = tmp_path / "zero.jsonl"
    link.symlink_to("/dev/zero")
    with pytest.raises(TraceError, match="a device, FIFO or socket, not a regular file"):
        open_trace(str(link))


def test_bad_lines_are_skipped_counted_and_reported(tmp_path, capsys):
    lines = [json.dumps(GOOD).encode(), b"{not json", b"[1, 2]",
             json.dumps({**GOOD, "hash_ids": [1]}).encode(), b'{"timestamp": \xff}',
             json.dumps({**GOOD, "timestamp": 9}).encode()]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "r.json"
    assert main(["replay", str(path), "--quiet", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("skipped 4 bad line(s)") == 1 and "line 2: not valid JSON" in err, err
    row = json.loads(out.read_text())["rows"][0]
    assert row["requests"] == 2 and row["skipped_lines"] == 4
    assert [k["line"] for k in row["skipped"]] == [2, 3, 4, 5]


def test_a_killed_synthesize_leaves_no_temporary_file(tmp_path):
    out = tmp_path / "big.jsonl"
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "replay", str(out), "--synthesize",
                             str(MAX_SYNTHESIZE)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None, "the write never started"
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []  # neither the temporary file nor a half trace
