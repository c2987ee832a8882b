"""`trainfit doctor`: the broken-config corpus (tests/data/doctor/README.md is its manifest), valid
configs with no error, machine checks on a faked NVML, and the CLI's exit code and JSON."""

from __future__ import annotations

import glob
import json
import shlex
import socket
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainfit.app.doctor import CODES, Finding, Options, run
from trainfit.app.doctor import machine as machine_mod

DATA = Path(__file__).parent / "data" / "doctor"
ROOT = Path(__file__).parent.parent


def manifest() -> list[tuple[str, str, str, str]]:
    rows = []
    for line in (DATA / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("files", "---"):
            rows.append(tuple(cells))
    return rows


def options(text: str) -> Options:
    opts, tokens = Options(plan=False), shlex.split(text)
    names = {"--num-gpus": ("num_gpus", int), "--gpu": ("gpu", str), "--model": ("model", str),
             "--cpu-ram-gb": ("cpu_ram_gb", float)}
    i = 0
    while i < len(tokens):
        if tokens[i] == "--plan":
            opts.plan = True
        else:
            attr, kind = names[tokens[i]]
            setattr(opts, attr, kind(tokens[i + 1]))
            i += 1
        i += 1
    return opts


def paths(files: str) -> list[str]:
    out = []
    for name in files.split():
        p = DATA / name
        out += sorted(str(f) for f in p.iterdir() if f.is_file()) if p.is_dir() else [str(p)]
    return out


CASES = manifest()


def test_manifest_covers_the_issue():
    # Every case the issue names, at least 15 broken configs, and only codes doctor knows.
    codes = {c[2] for c in CASES}
    assert len(CASES) >= 15
    assert codes <= set(CODES)
    assert {"ds.batch_mismatch", "ds.auto_unfilled", "ds.fp16_and_bf16", "ds.precision_mismatch", "ds.offload_cpu_ram",
            "accel.multi_gpu_one_process", "accel.no_with_processes", "accel.gpu_ids_count", "accel.machine_rank",
            "args.device_map_auto", "vllm.over_card", "vllm.max_model_len", "tf.grpo_groups", "tf.batch_world",
            "lr.not_scaled"} <= codes


@pytest.mark.parametrize("files,opts,code,severity", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_corpus_case(files, opts, code, severity):
    report = run(paths(files), options(opts), machine=False)
    got = [(f.code, f.severity) for f in report.findings]
    assert (code, severity) in got, f"{files}: expected {code}/{severity}, got {got}"
    assert report.exit_code == (1 if any(s == "error" for _, s in got) else 0)
    for f in report.findings:  # every finding says why and what to change
        assert f.message and f.fix and f.file


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "examples" / "*.yaml"))), ids=lambda p: Path(p).name)
def test_examples_have_no_error(path):
    report = run([path], Options(plan=False), machine=False)
    assert [f for f in report.findings if f.severity == "error"] == []


@pytest.mark.parametrize("folder", ["valid", "ds_auto_hf"])
def test_valid_files_have_no_error(folder):
    report = run(paths(folder), Options(plan=False), machine=False)
    assert [(f.code, f.message) for f in report.findings if f.severity == "error"] == []
    assert {d["kind"] for d in report.files} >= {"deepspeed"}


def test_exported_files_have_no_error(tmp_path):
    from trainfit.config import load_config
    from trainfit.app.export import export_all

    # Configs `trainfit train` runs (export refuses the rest: ZeRO-3, offload, PPO).
    variants = [("examples/sft_7b_zero2_offload.yaml", ["distributed.offload_optimizer=false", "distributed.num_gpus=2"]),
                ("examples/grpo_lora.yaml", ["distributed.num_gpus=4", "train.micro_batch_size=8"]),
                ("examples/sft_chat.yaml", ["distributed.strategy=fsdp", "distributed.num_gpus=2"]),
                ("examples/grpo_lora.yaml", ["distributed.num_nodes=2", "distributed.strategy=deepspeed",
                                             "distributed.zero_stage=1"])]
    for i, (path, ov) in enumerate(variants):
        files = export_all(load_config(ROOT / path, ov), tmp_path / str(i))
        report = run([str(p) for p in files.values()], Options(plan=False), machine=False)
        assert [(f.code, f.message) for f in report.findings if f.severity == "error"] == [], path
        kinds = {d["kind"] for d in report.files}
        assert {"trainfit", "accelerate", "commands"} <= kinds


def test_cross_field_messages_split_into_reason_and_fix():
    report = run([str(DATA / "tf_grpo_groups.yaml")], Options(plan=False), machine=False)
    f = next(f for f in report.findings if f.code == "tf.grpo_groups")
    assert "36" in f.message and "use 40" in f.fix.lower()


def test_unknown_code_is_a_bug():
    with pytest.raises(ValueError):
        Finding("no.such_code", "error", "m", "f")


class _NVMLError(Exception):
    pass


def _fake_nvml(gpus: int, cuda: int = 12040, busy_pid: int = 4242):
    """A pynvml stand-in: `gpus` H100s, the first with one other process holding 30 GB."""
    mod = types.ModuleType("pynvml")
    mem = types.SimpleNamespace(total=80 * 10 ** 9, used=30 * 10 ** 9, free=50 * 10 ** 9)
    if gpus < 0:
        def init():
            raise type("NVMLError_LibraryNotFound", (_NVMLError,), {})("NVML Shared Library Not Found")
        mod.nvmlInit = init
        return mod
    mod.nvmlInit = mod.nvmlShutdown = lambda: None
    mod.nvmlSystemGetDriverVersion = lambda: "550.54"
    mod.nvmlSystemGetCudaDriverVersion = lambda: cuda
    mod.nvmlDeviceGetCount = lambda: gpus
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"
    mod.nvmlDeviceGetMemoryInfo = lambda h: mem
    mod.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: (
        [types.SimpleNamespace(pid=busy_pid, usedGpuMemory=30 * 10 ** 9)] if h == 0 else [])
    mod.nvmlDeviceGetGraphicsRunningProcesses = lambda h: []
    mod.nvmlSystemGetProcessName = lambda pid: "python"
    return mod


def test_machine_without_nvml_says_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(-1))
    facts, findings = machine_mod.collect()
    assert facts["gpus"] == [] and "not found" in facts["gpu_status"]
    assert [f.code for f in findings if f.code == "machine.no_gpu"] == ["machine.no_gpu"]


def test_machine_with_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(2, cuda=11080))
    monkeypatch.setattr(machine_mod, "torch_facts", lambda: {"installed": True, "version": "2.6.0+cu124",
                                                             "cuda": "12.4", "hip": None})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    facts, findings = machine_mod.collect()
    assert len(facts["gpus"]) == 2 and facts["visible_gpus"] == 2 and facts["gpus"][0]["bf16"]
    assert facts["gpus"][0]["processes"][0]["pid"] == 4242
    codes = {(f.code, f.severity) for f in findings}
    assert ("machine.gpu_busy", "warning") in codes
    assert ("machine.driver_old", "error") in codes  # CUDA 11.8 driver, CUDA 12.4 torch
    assert not any(c == "machine.no_gpu" for c, _ in codes)


def test_machine_gpus_feed_the_lint(monkeypatch):
    # 2 GPUs visible and a single-process script with device_map="auto": the naive-pipeline warning.
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    report = run([str(DATA / "train_device_map.py")], Options(plan=False))
    assert ("args.device_map_auto", "warning") in {(f.code, f.severity) for f in report.findings}


def test_busy_port_and_bad_alloc_conf(monkeypatch):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen(1)
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segment:True")
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        _, findings = machine_mod.collect()
    codes = {f.code for f in findings}
    assert {"machine.port_busy", "machine.alloc_conf"} <= codes


def test_cli_json_and_exit_code():
    from trainfit.app.cli import app

    runner = CliRunner()
    bad = runner.invoke(app, ["doctor", "--no-machine", "--json", "--num-gpus", "2", str(DATA / "ds_batch_mismatch.json")])
    assert bad.exit_code == 1, bad.output
    data = json.loads(bad.output)
    assert data["summary"]["error"] >= 1 and data["findings"][0]["code"] == "ds.batch_mismatch"
    good = runner.invoke(app, ["doctor", "--no-machine", "--no-plan", str(ROOT / "examples" / "grpo_lora.yaml")])
    assert good.exit_code == 0, good.output


def test_cli_machine_report_on_this_machine():
    from trainfit.app.cli import app

    out = CliRunner().invoke(app, ["doctor"])
    assert out.exit_code in (0, 1), out.output  # 1 only for a machine-level error (e.g. an old driver)
    assert "Python" in out.output and "port" in out.output
    if not machine_mod.gpu_facts()["gpus"]:
        assert "No GPU" in out.output


def test_batch_check_without_a_world_size_says_it_was_skipped_and_what_to_pass(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1,
                              "gradient_accumulation_steps": 8}))
    alone = run([str(ds)], Options(plan=False), machine=False)
    skipped = [f for f in alone.findings if f.code == "ds.batch_unchecked"]
    assert len(skipped) == 1 and skipped[0].severity == "warning"
    assert "4 GPUs" in skipped[0].message and "not checked" in skipped[0].message
    assert "--num-gpus" in skipped[0].fix and "accelerate" in skipped[0].fix
    # The CLI shows it, not a bare "0 error(s)".
    from trainfit.app.cli import app

    out = CliRunner().invoke(app, ["doctor", "--no-machine", "--no-plan", str(ds)])
    assert out.exit_code == 0 and "ds.batch_unchecked" in out.output and "--num-gpus" in out.output
    # Given the world size (flag or a file of the same job), the check runs and the skip note goes away.
    flagged = run([str(ds)], Options(plan=False, num_gpus=2), machine=False)
    assert [f.code for f in flagged.findings] == ["ds.batch_mismatch"]
    for procs, codes in ((2, ["ds.batch_mismatch"]), (4, [])):
        acc = tmp_path / f"accelerate_{procs}.yaml"
        acc.write_text(f"distributed_type: DEEPSPEED\nnum_processes: {procs}\nnum_machines: 1\n")
        job = run([str(ds), str(acc)], Options(plan=False), machine=False)
        assert [f.code for f in job.findings if f.code.startswith("ds.batch")] == codes


# Files DeepSpeed's own config classes reject (real cases: FlagEmbedding #1487, DeepSpeed #2721), with
# the key doctor must name and a piece of the fix it must give.
REJECTED = [("ds_bf16_loss_scale.json", "bf16.loss_scale", "belongs to the fp16 section"),
            ("ds_bf16_loss_scale.json", "bf16.min_loss_scale", "belongs to the fp16 section"),
            ("ds_aio_in_zero.json", "zero_optimization.aio", "to the top level"),
            ("ds_partial_offload_zero2.json", "zero_optimization", "Partial offloading only supported for ZeRO "
                                                                   "Stage 3"),
            ("ds_partial_offload_zero2.json", "fp16.loss_scale_windw", "fp16.loss_scale_window")]


@pytest.mark.parametrize("name,key,fix", REJECTED, ids=[f"{r[0]}-{r[1]}" for r in REJECTED])
def test_files_deepspeed_rejects_are_reported_with_the_key_and_a_fix(deepspeed_config_parser, name, key, fix):
    parse = deepspeed_config_parser()  # skips without DeepSpeed
    with pytest.raises(Exception):  # DeepSpeed itself refuses the file (at any world size)
        parse(DATA / name, 1)
    report = run([str(DATA / name)], Options(plan=False), machine=False)
    hits = [f for f in report.findings if f.code == "ds.rejected" and f.message.split(": ")[1] == key]
    assert hits and fix in hits[0].fix and hits[0].severity == "error", [f.message for f in report.findings]
    assert report.exit_code == 1


def test_files_deepspeed_accepts_are_not_reported(deepspeed_config_parser, tmp_path):
    """The valid corpus file and a file each hand-written check flags for what DeepSpeed accepts: DeepSpeed
    builds its config from them, and doctor's DeepSpeed validation adds nothing."""
    parse = deepspeed_config_parser()
    for path, world in ((DATA / "valid" / "ds_config.json", 8), (DATA / "ds_nvme_no_path.json", 1),
                        (DATA / "ds_offload_client_optimizer" / "ds_config.json", 2)):
        parse(path, world)
        report = run([str(path)], Options(plan=False, num_gpus=world), machine=False)
        assert {f.code for f in report.findings} & {"ds.rejected", "ds.unvalidated"} == set(), path


def test_offload_without_optimizer_is_fine_under_accelerate(tmp_path):
    # accelerate (and the HF Trainer through it) convert a torch AdamW to DeepSpeedCPUAdam themselves.
    ds = tmp_path / "ds_config.json"
    ds.write_text((DATA / "ds_offload_client_optimizer" / "ds_config.json").read_text())
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds_config.json\n"
                   "num_processes: 2\nnum_machines: 1\n")
    report = run([str(ds), str(acc)], Options(plan=False), machine=False)
    assert "ds.offload_client_optimizer" not in {f.code for f in report.findings}


def test_without_deepspeed_the_hand_checks_run_and_doctor_says_the_deeper_check_was_skipped(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError
    for name in ("ds_partial_offload_zero2.json", "ds_nvme_no_path.json"):
        report = run([str(DATA / name)], Options(plan=False), machine=False)
        codes = {f.code: f for f in report.findings}
        assert "ds.rejected" not in codes and codes["ds.unvalidated"].severity == "info"
        assert "not installed" in codes["ds.unvalidated"].message and "pip install" in codes["ds.unvalidated"].fix
    assert "ds.nvme_path_missing" in codes  # trainfit's own check still ran


def test_deepspeed_section_shapes_and_deprecations(deepspeed_config_parser, tmp_path):
    # "fp16": true where DeepSpeed reads a mapping (rejected), and ZeRO's deprecated cpu_offload (accepted, warned).
    deepspeed_config_parser()
    bad, old = tmp_path / "bad.json", tmp_path / "old.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "fp16": True}))
    old.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                               "zero_optimization": {"stage": 2, "cpu_offload": True}}))
    f = next(f for f in run([str(bad)], Options(plan=False), machine=False).findings if f.code == "ds.rejected")
    assert "fp16 is bool, not a mapping" in f.message and '"fp16": {"enabled": true}' in f.fix
    found = run([str(old)], Options(plan=False), machine=False).findings
    f = next(f for f in found if f.code == "ds.deprecated")
    assert "cpu_offload" in f.message and f.fix == "Replace cpu_offload with offload_optimizer."
    assert "ds.rejected" not in {f.code for f in found}
