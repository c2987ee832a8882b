"""GPU facts through NVML (nvidia-ml-py), shared by `trainfit doctor` and the planner's detection.

Imports nothing heavy (no torch), never raises: without a driver or a GPU it says why in "status".
"""

from __future__ import annotations

from pathlib import Path

GB = 1e9


def _process_name(pynvml, pid: int) -> str:
    try:
        name = pynvml.nvmlSystemGetProcessName(pid)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return "?"


def gpu_facts() -> dict:
    """GPUs through NVML: {"status": "ok"|reason, "driver", "cuda_driver", "gpus": [...]}. Never raises."""
    out: dict = {"status": "ok", "driver": None, "cuda_driver": None, "gpus": []}
    try:
        import pynvml
    except ImportError:
        out["status"] = "nvidia-ml-py (pynvml) is not installed, so GPUs cannot be queried"
        return out
    try:
        pynvml.nvmlInit()
    except Exception as e:
        name = type(e).__name__
        if "LibraryNotFound" in name or "Library Not Found" in str(e):
            out["status"] = "the NVML library (libnvidia-ml.so) is not found: no NVIDIA driver is installed"
        elif "DriverNotLoaded" in name:
            out["status"] = "the NVIDIA driver is installed but not loaded (no GPU, or the kernel module failed)"
        else:
            out["status"] = f"NVML failed to start: {e}"
        return out
    try:
        drv = pynvml.nvmlSystemGetDriverVersion()
        out["driver"] = drv.decode() if isinstance(drv, bytes) else str(drv)
        try:
            c = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040 -> 12.4
            out["cuda_driver"] = f"{c // 1000}.{c % 1000 // 10}"
        except Exception:
            pass
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                cc = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h))
            except Exception:
                cc = None
            procs = []
            for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    for p in getattr(pynvml, getter)(h):
                        used = getattr(p, "usedGpuMemory", None)
                        procs.append({"pid": int(p.pid), "name": _process_name(pynvml, int(p.pid)),
                                      "used_gb": round(used / GB, 2) if isinstance(used, int) else None})
                except Exception:
                    pass
            out["gpus"].append({
                "index": i, "name": name.decode() if isinstance(name, bytes) else str(name),
                "total_bytes": int(mem.total), "free_bytes": int(mem.free),
                "total_gb": round(mem.total / GB, 2), "used_gb": round(mem.used / GB, 2),
                "free_gb": round(mem.free / GB, 2), "compute_capability": ".".join(map(str, cc)) if cc else None,
                "bf16": cc[0] >= 8 if cc else None, "processes": procs})
        if not out["gpus"]:
            out["status"] = f"NVML works (driver {out['driver']}) but shows no GPU"
    except Exception as e:
        out["status"] = f"NVML query failed: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out
