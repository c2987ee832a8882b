"""The GPU check kit (bench/gpu_check.py, bench/gpu_wheels.py) keeps working without a GPU.

The rehearsal (`--dry`: CPU, toy shapes) of the cheapest steps runs here as a subprocess and must
write each step's JSON with its rows and the machine it ran on; the full rehearsal (every step) is
`make gpu-check-dry` in .ci/run. The budget guard, pytest's summary parsing and the wheel kit's
dependency closure are checked on their own, offline (a fake `pip download`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_check, gpu_wheels  # noqa: E402
from bench.gpu_pool import Job, Pool  # noqa: E402
from bench.gpu_steps import STEPS  # noqa: E402

CHEAP = ["decode", "oom", "grpo-vllm"]


@pytest.mark.gpukit   # `make gpu-check-dry` runs it, beside the whole rehearsal (.ci/run): not in `make test`
def test_rehearsal_of_the_cheapest_steps_writes_every_json(tmp_path):
    """train.device=cpu throughout: decode speed on a toy model, an injected OOM recovered by the
    real trainer, and the vLLM step written as not-run where vllm is missing."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry", "--steps", ",".join(CHEAP),
                        "--out", str(out), "--work", str(tmp_path / "work")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(f.name for f in out.glob("check-*.json")) == sorted(f"check-{s}.json" for s in CHEAP)
    docs = {s: json.loads((out / f"check-{s}.json").read_text()) for s in CHEAP}
    for name, d in docs.items():
        assert d["check"] == name and d["rehearsal"] is True and d["rows"], name
        assert d["machine"]["device"] == "cpu" and d["machine"]["torch"] and d["machine"]["source_sha256"]
        assert all(set(r) == {"check", "goal", "measured", "result"} for r in d["rows"])
        assert d["status"] in ("rehearsal", "not-run"), (name, d["rows"])
    # The decode step measured the kit's three engines on the same prompts, a row each for graphs vs
    # generate, the bandwidth and the first call; the OOM step went through the trainer's recovery
    # (micro-batch 4 -> 2, both steps done) and says the OOM was injected.
    engines = docs["decode"]["details"]["result"]["engines"]
    assert set(engines) == {"cuda-graphs", "cuda-graphs-nocodegen", "hf-generate"}
    assert engines["cuda-graphs"]["profile"]["top_cpu"]
    assert all(e["tokens_per_s"] > 0 for e in engines.values())
    assert [r["check"] for r in docs["decode"]["rows"]] == [
        "decode: CUDA graphs vs HF generate", "decode: tokens/s against the card's bandwidth",
        "decode: first call over a later one"]
    case = docs["oom"]["details"]["result"]["cases"][0]
    assert case["ooms"] == 1 and case["micro_after_oom"] == [2] and case["steps"] == 2 and case["injected_oom"]
    assert "injected" in docs["oom"]["rows"][0]["measured"]
    vllm = docs["grpo-vllm"]
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        assert vllm["status"] == "not-run" and "vllm is not importable" in vllm["rows"][0]["measured"]
    # The table is printed once, with a row per check.
    assert p.stdout.count("| check ") == 1 and "injected" in p.stdout


def test_a_step_without_enough_budget_is_written_as_not_run(tmp_path, capsys):
    rc = gpu_check.main(["--dry", "--steps", "plan,grpo", "--budget", "1", "--out", str(tmp_path),
                         "--work", str(tmp_path / "w")])
    assert rc == 0
    for name in ("plan", "grpo"):
        d = json.loads((tmp_path / f"check-{name}.json").read_text())
        assert d["status"] == "not-run" and f"make gpu-check STEPS={name}" in d["rows"][0]["measured"]
    # --summary-only prints the same table from the files.
    capsys.readouterr()
    gpu_check.main(["--summary-only", "--out", str(tmp_path)])
    assert capsys.readouterr().out.count("not-run") == 2


def test_every_step_is_in_one_group_and_the_default_command_fits_nine_minutes():
    from bench.gpu_steps import DEFAULT, GROUPS

    assert sorted(s for g in GROUPS for s in g) == sorted(STEPS)
    assert "plan-grid" not in DEFAULT and set(DEFAULT) | {"plan-grid"} == set(STEPS)
    # A group lasts as long as its longest step; the H100 times kept for the groups (measured 2026-11-27,
    # bench/gpu_steps.py's estimates for what was added since) add up within the default budget (540 s),
    # the wheels' install and machine probe (18 s there) and the reserve included.
    kept = sum(max(STEPS[s].expect_s for s in g) for g in GROUPS if any(s in DEFAULT for s in g))
    assert kept + gpu_check.RESERVE_S + 18 <= 540, kept


def test_the_live_log_names_failures_as_they_happen_also_when_the_run_is_cut(tmp_path):
    """bench/pytest_live.py: how many tests were collected, then one JSON line per outcome with the
    failure's first error line, written before the run ends (the run is killed inside its third test,
    which never reports; the test's module lines are collected, outcome, outcome)."""

    (tmp_path / "test_x.py").write_text(
        "import time\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 + 1 == 3, 'arithmetic broke'\n"
        "def test_hangs():\n    time.sleep(60)\n")
    live = tmp_path / "live.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.pytest_live",
                             "--live-log", str(live), "-o", "addopts=", str(tmp_path / "test_x.py")],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.time()
        while time.time() - t0 < 60 and (not live.exists() or live.read_text().count("\n") < 3):
            time.sleep(0.1)
        assert proc.poll() is None   # still inside test_hangs: what the file holds was written before the end
    finally:
        proc.kill()
        proc.wait()
    rows = [json.loads(x) for x in live.read_text().splitlines()]
    assert rows[0]["collected"] == 3
    assert [(r["nodeid"].split("::")[1], r["outcome"]) for r in rows[1:]] == [("test_ok", "passed"), ("test_bad", "failed")]
    assert "arithmetic broke" in rows[2]["error"] and rows[2]["gpu"] is False


def test_the_tests_step_counts_each_test_once_at_its_worst_phase(tmp_path):
    from bench.gpu_steps import live_outcomes

    lines = [{"collected": 3},
             {"nodeid": "t::a", "when": "call", "outcome": "failed", "error": "boom"},
             {"nodeid": "t::a", "when": "teardown", "outcome": "error", "error": "fixture"},
             {"nodeid": "t::b", "when": "call", "outcome": "passed"}]
    path = tmp_path / "live.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"nodeid": "t::c", "outc')   # cut mid-line
    outcomes, total = live_outcomes(path)
    assert total == 3 and sorted((o["nodeid"], o["outcome"]) for o in outcomes) == [("t::a", "error"), ("t::b", "passed")]


def test_the_pool_admits_by_planned_memory_and_cuts_at_the_deadline(tmp_path):
    """bench/gpu_pool.py: two jobs whose peaks together exceed the capacity run one after the other,
    two that fit run side by side, and a job still running at the deadline is killed and marked cut."""
    import time

    def job(name, peak, seconds):
        return Job(name, [sys.executable, "-c", f"import time; time.sleep({seconds})"], peak, tmp_path / f"{name}.log")

    pool = Pool(capacity_gib=10, deadline=time.time() + 60, cwd=tmp_path)
    for j in (job("a", 6, 0.5), job("b", 6, 0.5), job("c", 3, 0.5)):
        pool.add(j)
    pool.close()
    done = {j.name: j for j in pool.run(poll_s=0.05)}
    assert all(j.rc == 0 and not j.cut for j in done.values())
    a, b, c = (done[n] for n in "abc")
    assert b.started >= a.started + a.seconds - 0.1          # b waited for a: 6 + 6 > 10
    assert c.started < a.started + a.seconds                  # c ran beside a: 6 + 3 <= 10
    late = Pool(capacity_gib=10, deadline=time.time() + 1.0, cwd=tmp_path)
    late.add(job("slow", 1, 30))
    late.close()
    (slow,) = late.run(poll_s=0.05)
    assert slow.cut and slow.rc != 0 and slow.seconds < 10


def fake_wheel(path: Path, name: str, version: str, requires: list[str]) -> Path:
    whl = path / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return whl


def test_wheel_kit_follows_requirements_the_image_lacks(tmp_path, monkeypatch):
    """A wanted wheel's requirements: ones the image has are not downloaded, a missing one is (once),
    extras and markers that do not hold on Python 3.12 Linux are ignored."""
    reqs = {"top": ["numpy>=1.17", "newdep>=1", "newdep<3", "windows-only; sys_platform == 'win32'",
                    "docs-only; extra == 'docs'", "old-py; python_version < '3.10'", "torch>=2"],
            "newdep": ["numpy"], "other": ["newdep"]}
    calls = []

    def download(req, dest):
        name = gpu_wheels.Requirement(req).name
        calls.append(req)
        return fake_wheel(dest, name, "1.0", reqs.get(name, []))

    monkeypatch.setattr(gpu_wheels, "download", download)
    monkeypatch.setattr(gpu_wheels, "WANTED", [("top==1.0", True, "x"), ("other==1.0", False, "y")])
    items = gpu_wheels.collect(tmp_path)
    assert [it["name"] for it in items] == ["top", "other", "newdep"]
    assert calls.count("newdep>=1") == 1 and len(calls) == 3      # numpy and torch are on the image
    dep = items[-1]
    assert dep["essential"] is True and "top needs" in dep["why"]   # a need of an essential wheel is essential
    assert not gpu_wheels.image_satisfies(gpu_wheels.Requirement("torch>=2.12"))   # the image has 2.11.0
    assert gpu_wheels.image_satisfies(gpu_wheels.Requirement("torch>=2.4"))


@pytest.mark.parametrize("name", sorted(STEPS))
def test_step_limits_fit_a_device_command(name):
    s = STEPS[name]
    assert 0 <= s.min_s < s.limit_s <= 600 - gpu_check.RESERVE_S


def test_wheel_listing_names_each_wheel_its_size_rank_and_whether_the_image_has_it(tmp_path, monkeypatch, capsys):
    """`make gpu-wheels`' listing, offline: every carried wheel with its MiB, essential or optional and
    the image column; an optional wheel past the budget is dropped, the total is stated against it."""
    sizes = {"top": 4000, "typing-extensions": 3000, "opt": 200_000}

    def download(req, dest):
        name = gpu_wheels.Requirement(req).name
        whl = fake_wheel(dest, name, "1.0", [])
        with zipfile.ZipFile(whl, "a", compression=zipfile.ZIP_STORED) as z:  # pad to the wanted size
            z.writestr("pad", os.urandom(sizes[name]))
        return whl

    monkeypatch.setattr(gpu_wheels, "download", download)
    monkeypatch.setattr(gpu_wheels, "repo_bytes", lambda: 10_000)
    monkeypatch.setattr(gpu_wheels, "BUDGET", 100_000)
    monkeypatch.setattr(gpu_wheels, "WANTED", [("top==1.0", True, "x"), ("typing-extensions==1.0", True, "y"),
                                               ("opt==1.0", False, "z")])
    kit = tmp_path / "kit"
    manifest = gpu_wheels.main(["--kit", str(kit), "--no-tokenizer"])
    lines = capsys.readouterr().out.splitlines()
    for name, image in (("top", "no"), ("typing_extensions", "yes (")):
        line = next(x for x in lines if f"{name}-1.0-py3-none-any.whl" in x)
        mib = os.path.getsize(kit / "wheels" / f"{name}-1.0-py3-none-any.whl") / 2**20
        assert f"{mib:6.2f}" in line and "essential" in line and image in line, line
    assert any("DROPPED" in x and "opt-1.0" in x for x in lines)
    assert not (kit / "wheels" / "opt-1.0-py3-none-any.whl").exists()
    assert any(x.startswith("   not carried: vllm") for x in lines)
    assert any(x.startswith("   not carried: torch: on the image") for x in lines)
    total = next(x for x in lines if x.startswith("carried in all:"))
    assert f"{manifest['total_bytes'] / 2**20:.1f} MiB of the" in total and manifest["over_budget"] is False
    assert json.loads((kit / "MANIFEST.json").read_text())["dropped"][0]["name"] == "opt"
    # Essential wheels are kept past the budget, and the listing says the kit cannot travel.
    monkeypatch.setattr(gpu_wheels, "BUDGET", 12_000)
    assert gpu_wheels.main(["--kit", str(kit), "--no-tokenizer"])["over_budget"] is True
    assert "OVER THE BUDGET" in capsys.readouterr().out


def test_snapshot_wrapper_runs_the_cli_and_writes_its_file_without_cuda(tmp_path, capsys, monkeypatch):
    """bench/gpu_snapshot.py on CPU (the rehearsal): the wrapped trainfit command runs, its exit code
    comes back, and the snapshot path gets a note instead of a CUDA memory history."""
    from bench import gpu_snapshot

    monkeypatch.setattr(gpu_snapshot.torch.cuda, "is_available", lambda: False)   # as on a CPU machine
    out = tmp_path / "snapshot-x.pickle"
    assert gpu_snapshot.main([str(out), "keys", "train.device"]) == 0
    assert "train.device" in capsys.readouterr().out
    assert json.loads(out.read_text())["rehearsal"] is True
    assert gpu_snapshot.main([str(tmp_path / "bad.pickle"), "keys", "--no-such-option"]) != 0
    assert (tmp_path / "bad.pickle").exists()   # a failed run's snapshot is written too


def test_a_case_planned_under_says_whether_its_snapshot_was_taken():
    """The plan row names the snapshot file, or why a case planned > 5% under has none (the per-step
    cap that keeps a command within the GPU machine's 8 returned files, or the budget)."""
    from bench.gpu_steps import case_row

    case = {"case": "c", "result": "fail", "run": {"rc": 0},
            "phases": {"train": {"planned_gib": 7.24, "used_gib": 8.63, "error": -0.161}}}
    taken = case_row({**case, "snapshot": {"file": "snapshot-c.pickle", "rc": 0}}, "recorded")
    assert "-16.1%" in taken["measured"] and "snapshot snapshot-c.pickle.gz" in taken["measured"]
    skipped = case_row({**case, "snapshot": {"file": None, "skipped": "2 snapshots already taken"}}, "recorded")
    assert "no snapshot: 2 snapshots already taken" in skipped["measured"]
    failed = case_row({**case, "snapshot": {"file": None, "rc": 1}}, "recorded")
    assert "no snapshot: its run failed" in failed["measured"]


def synthetic_snapshot() -> dict:
    """A snapshot in PyTorch's format: a 1000-byte weight from before the trace; A (100 bytes, trainfit)
    and B (50, transformers) allocated, A freed, C (30) allocated."""
    tf = [{"filename": "/x/torch/nn/modules/linear.py", "line": 1, "name": "forward"},
          {"filename": "/x/trainfit/algos/loss.py", "line": 7, "name": "token_loss"}]
    hf = [{"filename": "/x/transformers/models/qwen2/modeling_qwen2.py", "line": 9, "name": "forward"}]
    return {"segments": [{"device": 0, "blocks": [{"address": 1, "size": 1000, "state": "active_allocated"},
                                                   {"address": 30, "size": 30, "state": "active_allocated"}]}],
            "device_traces": [[{"action": "alloc", "addr": 10, "size": 100, "frames": tf},
                               {"action": "alloc", "addr": 20, "size": 50, "frames": hf},
                               {"action": "free_requested", "addr": 10, "size": 100, "frames": tf},
                               {"action": "free_completed", "addr": 10, "size": 100, "frames": tf},
                               {"action": "alloc", "addr": 30, "size": 30, "frames": hf}]]}


def test_snapshot_peak_names_what_was_alive_at_the_peak(tmp_path):
    """bench/snapshot_peak.py on a snapshot in PyTorch's format: the peak of the replayed trace (A and B
    alive: 100 + 50 bytes, before A is freed and C allocated) plus the blocks allocated before the
    trace (the 1000-byte weight), grouped by the innermost trainfit frame, else the library's."""
    import gzip
    import pickle

    from bench import snapshot_peak

    path = tmp_path / "snapshot-c.pickle.gz"
    with gzip.open(path, "wb") as f:
        pickle.dump(synthetic_snapshot(), f)
    res = snapshot_peak.main([str(path)])
    assert res["peak_traced_bytes"] == 150 and res["before_trace_bytes"] == 1000 and res["peak_bytes"] == 1150
    assert res["sites"] == [("trainfit/algos/loss.py:7 token_loss", 100),
                            ("transformers/models/qwen2/modeling_qwen2.py:9 forward", 50)]


def test_a_snapshot_too_big_to_come_back_is_read_where_it_was_taken(tmp_path, monkeypatch):
    """The plan step gzips each snapshot; one over the returned-file limit (here: any) stays in the
    scratch directory, and what was alive at its peak is written beside the JSON files instead."""
    import pickle

    from bench import gpu_steps

    snap = synthetic_snapshot()
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    (out / "snapshot-c.pickle").write_bytes(pickle.dumps(snap))
    monkeypatch.setattr(gpu_steps, "MAX_FILE", 0)
    ctx = gpu_check.Ctx(dry=True, out=out, work=work, deadline=float("inf"),
                        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    kept = gpu_steps.keep_snapshots(ctx)
    assert sorted(f.name for f in out.iterdir()) == ["snapshot-c.peak.json"]
    assert (work / "snapshot-c.pickle.gz").is_file() and "peak in snapshot-c.peak.json" in kept["snapshot-c.pickle.gz"]
    assert json.loads((out / "snapshot-c.peak.json").read_text())["peak_bytes"] == 1150


def test_run_first_puts_gpu_marked_tests_then_the_named_files_ahead_of_the_rest(tmp_path):
    """bench/pytest_live.py --run-first: the gpu-marked test, then the named file's tests, then the
    others in their own order (the file named first sorts last alphabetically)."""
    (tmp_path / "test_a.py").write_text("def test_a1():\n    pass\ndef test_a2():\n    pass\n")
    (tmp_path / "test_b.py").write_text("import pytest\ndef test_b1():\n    pass\n"
                                        "@pytest.mark.gpu\ndef test_b_gpu():\n    pass\n")
    (tmp_path / "test_z.py").write_text("def test_z1():\n    pass\n")
    (tmp_path / "conftest.py").write_text("def pytest_configure(config):\n"
                                          "    config.addinivalue_line('markers', 'gpu: needs a GPU')\n")
    live = tmp_path / "live.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.pytest_live",
                        "--live-log", str(live), "--run-first", "test_z.py", "-o", "addopts=", "-p", "no:xdist"],
                       check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:]
    order = [json.loads(x)["nodeid"].split("::")[1] for x in live.read_text().splitlines() if "nodeid" in x]
    assert order == ["test_b_gpu", "test_z1", "test_a1", "test_a2", "test_b1"]


def test_the_tests_step_runs_the_static_step_and_padding_free_files_first():
    from bench.gpu_steps import FIRST_TESTS

    assert {"tests/test_static_cache.py", "tests/test_padding_free.py"} <= set(FIRST_TESTS)
    assert all((ROOT / f).is_file() for f in FIRST_TESTS)


def test_decode_rows_name_the_engines_a_cut_run_did_not_reach():
    """A decode run stopped after the two graph engines: the graphs-vs-generate row is `cut` and says
    hf-generate was not reached; the bandwidth and first-call rows judge what was measured."""
    from bench.gpu_steps import decode_rows

    def engine(tps, warm, call_s):
        return {"tokens_per_s": tps, "s_per_decode_step": 128 / tps, "warmup_s": warm, "cuda_graphs": True,
                "bandwidth_fraction": tps / 400_000, "calls": [{"seconds": call_s}]}

    d = {"partial": True, "rows_per_call": 128, "max_new_tokens": 256, "bandwidth_limit_tokens_per_s": 400_000,
         "engines": {"cuda-graphs": engine(41_000, 12.0, 0.8), "cuda-graphs-nocodegen": engine(30_000, 4.0, 1.1)}}
    ratio, bandwidth, first = decode_rows(d, dry=False)
    assert ratio["result"] == "cut" and "before hf-generate" in ratio["measured"]
    assert bandwidth["result"] == "pass" and "10.2% of the bandwidth limit" in bandwidth["measured"]
    assert first["result"] == "fail" and "+11.2 s" in first["measured"] and "+2.9 s" in first["measured"]
    d["engines"]["hf-generate"] = engine(2_500, 0.5, 13.0)
    ratio = decode_rows(d, dry=False)[0]
    assert ratio["result"] == "pass" and "16.40x" in ratio["measured"]


def test_a_variant_row_compares_with_the_default_run_and_says_when_it_was_cut():
    from bench.gpu_steps import variant_row

    default = {"steps_per_s": {"median": 0.2}, "train_tokens_per_s": {"median": 24_000.0}, "peak_mem_mb": {"median": 1500.0}}
    v = {"figures": {"steps_per_s": 0.22, "train_tokens_per_s": 30_000.0, "peak_mem_mb": 1400.0},
         "over_default": {"steps_per_s": 1.1, "train_tokens_per_s": 1.25, "peak_mem_mb": 0.933}, "first_step_s": 9.5}
    r = variant_row("grpo-gpu-0.5b", "train.padding_free=on", v, default, timed_out=False, dry=False)
    assert r["result"] == "info" and "(1.10x)" in r["measured"] and "30000 vs 24000 (1.25x)" in r["measured"]
    assert "1400 vs 1500 MiB (0.93x)" in r["measured"]
    cut = variant_row("grpo-gpu-0.5b", "train.padding_free=on", None, default, timed_out=True, dry=False)
    assert cut["result"] == "cut" and "cut at the step's limit" in cut["measured"]


def test_bench_run_variant_reruns_trainfit_with_its_overrides_and_compares(tmp_path, monkeypatch):
    """bench.run --variant: trainfit once more on the prepared spec with the overrides, figures over the
    default trainfit run's (the side process replaced by a stub that records the spec it got)."""
    from bench import run as bench_run
    from bench.workloads import WORKLOADS

    seen = []

    def fake_side(side, spec, seed, work, timeout):
        seen.append((side, spec.overrides, spec.model_dir))
        return {"step_s": [9.0, 4.0, 4.0], "gen_s": [8.0, 3.0, 3.0], "gen_tokens": [100, 100, 100],
                "train_tokens": [300, 300, 300], "reward": [], "loss": [], "peak_rss_mb": 900.0}

    monkeypatch.setattr(bench_run, "run_side", fake_side)
    spec = WORKLOADS["grpo-gpu-0.5b"].to_json() | {"model_dir": "/m"}
    result = {"settings": spec, "measurement": {"model_facts": None},
              "sides": {"trainfit": {"steps_per_s": {"median": 0.2}, "train_tokens_per_s": {"median": 200.0},
                                     "gen_tokens_per_s": {"median": 33.0}, "peak_mem_mb": {"median": 1000.0}}}}
    args = type("A", (), {"timeout": 60})()
    out = bench_run.run_variants(result, ["train.padding_free=on"], args, tmp_path)
    assert seen == [("trainfit", ("train.padding_free=on",), "/m")]
    v = out["train.padding_free=on"]
    assert v["overrides"] == ["train.padding_free=on"] and v["first_step_s"] == 9.0
    assert v["over_default"]["steps_per_s"] == pytest.approx(0.25 / 0.2)
    assert v["over_default"]["train_tokens_per_s"] == pytest.approx(300.0 / 200.0)
    assert v["over_default"]["peak_mem_mb"] == pytest.approx(0.9)


def test_the_qlora_case_starts_first_and_records_its_snapshot_in_that_run():
    from bench.gpu_case_table import cases

    first = cases("recorded")[0]
    assert first["case"] == "sft-q4b-qlora-2k-m2-ckpt" and first["snapshot_first"]
