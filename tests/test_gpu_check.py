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
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_check, gpu_wheels  # noqa: E402
from bench.gpu_steps import STEPS, pytest_counts  # noqa: E402

CHEAP = ["decode", "oom", "grpo-vllm"]


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
    # The decode step measured three engines on the same prompts; the OOM step went through the
    # trainer's recovery (micro-batch 4 -> 2, both steps done) and says the OOM was injected.
    engines = docs["decode"]["details"]["result"]["engines"]
    assert set(engines) == {"cuda-graphs", "trainfit-dynamic", "hf-generate"}
    assert all(e["tokens_per_s"] > 0 for e in engines.values())
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


def test_every_step_is_in_one_of_the_documented_commands():
    assert sorted(s for c in gpu_check.COMMANDS for s in c) == sorted(STEPS)


def test_pytest_summary_counts():
    text = "....\nFAILED tests/x.py::t - boom\n2 failed, 10 passed, 3 skipped, 1 xfailed in 12.34s\n"
    assert pytest_counts(text) == {"failed": 2, "passed": 10, "skipped": 3, "xfailed": 1}
    assert pytest_counts("== 4 passed, 1 error in 0.50s ==") == {"passed": 4, "error": 1}
    assert pytest_counts("no summary here") == {}


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
