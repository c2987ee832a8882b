"""Facts about this machine and the findings they imply: versions, GPUs, memory, ports, extras.

Doctor must answer in well under 5 s on any machine, so nothing heavy is imported: versions come
from package metadata, torch's CUDA build from the text of torch/version.py, GPUs from NVML
(nvidia-ml-py, a thin ctypes binding), optional extras from importlib.util.find_spec.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import re
import sys
from pathlib import Path
from typing import Optional

from trainfit.app.doctor.findings import Finding
from trainfit.core.machine import cpu_ram
from trainfit.core.nvml import gpu_facts
from trainfit.core.ports import DEFAULT_PORT, port_free

GB = 1e9
# Optional extras: module name to import -> distribution name for the version.
EXTRAS = {"deepspeed": "deepspeed", "bitsandbytes": "bitsandbytes", "vllm": "vllm", "flash_attn": "flash-attn",
          "gguf": "gguf", "trl": "trl", "peft": "peft", "accelerate": "accelerate"}
# Options of torch's caching allocator config (c10/core/AllocatorConfig.cpp and CUDAAllocatorConfig);
# torch raises "Unrecognized key" on anything else.
ALLOC_KEYS = {"max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
              "garbage_collection_threshold", "expandable_segments", "release_lock_on_cudamalloc",
              "pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
              "pinned_reserve_segment_size_mb", "backend", "per_process_memory_fraction",
              "graph_capture_record_stream_reuse", "release_lock_on_hipmalloc", "pinned_use_hip_host_register"}


def _version(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def torch_facts() -> dict:
    """torch version and the CUDA it was built with, read without importing torch (~1-2 s saved)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return {"installed": False, "version": None, "cuda": None, "hip": None}
    text = ""
    vfile = Path(spec.origin).parent / "version.py"
    if vfile.is_file():
        text = vfile.read_text(errors="replace")

    def field(name: str) -> Optional[str]:
        m = re.search(rf"^{name}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        return m.group(1) if m else None
    return {"installed": True, "version": _version("torch") or field("__version__"), "cuda": field("cuda"),
            "hip": field("hip")}


def nccl_version() -> Optional[str]:
    """NCCL from the nvidia-nccl wheel torch depends on, else from a system libnccl; None when absent."""
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11", "nvidia-nccl"):
        v = _version(dist)
        if v:
            return v
    try:
        import ctypes

        lib = ctypes.CDLL("libnccl.so.2")
        code = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(code)) == 0:
            c = code.value  # NCCL >= 2.9 encodes major*10000 + minor*100 + patch
            return f"{c // 10000}.{c % 10000 // 100}.{c % 100}"
    except (OSError, AttributeError):
        pass
    return None


def visible_gpu_count(gpus: list) -> int:
    """GPUs a CUDA process here would see: NVML's count narrowed by CUDA_VISIBLE_DEVICES."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return len(gpus)
    ids = [x for x in cvd.split(",") if x.strip() and x.strip() != "-1"]
    return min(len(ids), len(gpus))


def collect(port: Optional[int] = None) -> tuple[dict, list[Finding]]:
    """Facts about this machine and the machine-level findings."""
    findings: list[Finding] = []
    torch = torch_facts()
    g = gpu_facts()
    port = port or int(os.environ.get("MASTER_PORT", DEFAULT_PORT) or DEFAULT_PORT)
    alloc_var = "PYTORCH_ALLOC_CONF" if os.environ.get("PYTORCH_ALLOC_CONF") else "PYTORCH_CUDA_ALLOC_CONF"
    facts = {
        "python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
        "torch": torch, "nccl": nccl_version(), "driver": g["driver"], "cuda_driver": g["cuda_driver"],
        "gpu_status": g["status"], "gpus": g["gpus"], "visible_gpus": visible_gpu_count(g["gpus"]),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "cpu_ram": cpu_ram(),
        "alloc_conf": {"variable": alloc_var, "value": os.environ.get(alloc_var)},
        "port": {"port": port, "free": port_free(port)},
        "extras": {mod: (_version(dist) or "installed") if importlib.util.find_spec(mod) else None
                   for mod, dist in EXTRAS.items()},
    }
    if not torch["installed"]:
        findings.append(Finding("machine.torch_missing", "error", "torch is not installed in this Python "
                                f"({sys.executable}).", "pip install torch (a CUDA build on GPU machines: see "
                                "pytorch.org for the index URL matching your driver)."))
    if not g["gpus"]:
        findings.append(Finding("machine.no_gpu", "warning", f"No GPU is present: {g['status']}. Training here "
                                "runs on the CPU only (train.device=cpu), which is for tiny models and tests.",
                                "Run on a machine with an NVIDIA GPU and driver; to size a job for a card you do "
                                "not have, use `trainfit plan CONFIG --gpu h100` (or any catalog card)."))
    elif torch["installed"] and not torch["cuda"] and not torch["hip"]:
        findings.append(Finding("machine.torch_cpu_build", "warning", f"{len(g['gpus'])} GPU(s) are present but "
                                f"torch {torch['version']} is a CPU-only build, so training cannot use them.",
                                "Install a CUDA build of torch, e.g. pip install torch --index-url "
                                f"https://download.pytorch.org/whl/cu{(g['cuda_driver'] or '12.4').replace('.', '')}"))
    findings += _driver_findings(torch.get("cuda"), g["cuda_driver"], g["driver"])
    for gpu in g["gpus"]:
        others = [p for p in gpu["processes"] if p["pid"] != os.getpid()]
        if others or gpu["used_gb"] > 0.05 * gpu["total_gb"] + 1.0:
            who = ", ".join(f"{p['name']} (pid {p['pid']}, {p['used_gb'] if p['used_gb'] is not None else '?'} GB)"
                            for p in others) or "processes NVML cannot list (another container?)"
            findings.append(Finding("machine.gpu_busy", "warning", f"GPU {gpu['index']} ({gpu['name']}) has "
                                    f"{gpu['used_gb']:.1f} of {gpu['total_gb']:.1f} GB in use by {who}; a job "
                                    f"planned for the whole card gets only {gpu['free_gb']:.1f} GB.",
                                    "Stop those processes (kill PID), or choose other GPUs with "
                                    "CUDA_VISIBLE_DEVICES, or plan with less memory (hardware.memory_margin)."))
    if not facts["port"]["free"]:
        findings.append(Finding("machine.port_busy", "warning", f"TCP port {port} (the torchrun/DeepSpeed/accelerate "
                                "rendezvous port) is already in use; a multi-GPU launch on it fails with "
                                "'address already in use'.", "Pick a free port: export MASTER_PORT=29501 (torchrun "
                                "--master_port / deepspeed --master_port / accelerate main_process_port), or "
                                "torchrun --standalone, or stop the process holding it (ss -ltnp | grep "
                                f"{port})."))
    findings += _alloc_conf_findings(alloc_var, facts["alloc_conf"]["value"])
    return facts, findings


def _driver_findings(torch_cuda: Optional[str], cuda_driver: Optional[str], driver: Optional[str]) -> list[Finding]:
    if not torch_cuda or not cuda_driver:
        return []
    try:
        t = tuple(int(x) for x in torch_cuda.split(".")[:2])
        d = tuple(int(x) for x in cuda_driver.split(".")[:2])
    except ValueError:
        return []
    if d >= t:
        return []
    # Same major: CUDA minor-version compatibility runs most kernels, but PTX JIT and new APIs fail.
    sev = "error" if d[0] < t[0] else "warning"
    return [Finding("machine.driver_old", sev, f"torch was built with CUDA {torch_cuda} but driver {driver} supports "
                    f"CUDA {cuda_driver}" + (": CUDA initialisation will fail." if sev == "error" else
                                             ": minor-version compatibility covers most, not all, kernels."),
                    f"Upgrade the NVIDIA driver to one supporting CUDA {torch_cuda}, or install the torch build "
                    f"for CUDA {cuda_driver} (https://download.pytorch.org/whl/cu{cuda_driver.replace('.', '')}).")]


def _alloc_conf_findings(var: str, value: Optional[str]) -> list[Finding]:
    if not value:
        return []
    bad = []
    for part in value.split(","):
        key, sep, _ = part.partition(":")
        if not part.strip():
            continue
        if not sep or key.strip() not in ALLOC_KEYS:
            bad.append(part.strip())
    if not bad:
        return []
    return [Finding("machine.alloc_conf", "warning", f"{var}={value!r} has option(s) {bad} that torch does not "
                    "recognise; the first CUDA allocation raises an error.",
                    f"Use key:value pairs separated by commas, e.g. {var}=expandable_segments:True "
                    f"(valid keys: {', '.join(sorted(ALLOC_KEYS)[:6])}, ...).")]
