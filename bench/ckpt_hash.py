"""What a checkpoint's manifest costs: torch.save of an optimizer-sized state with and without hashing it on
the way to the disk, and the read that verifies it on a resume; plus the standard library's hashes alone.

    .venv/bin/python -m bench.ckpt_hash [--mib 512] [--repeat 5] [--dir DIR] [--out bench/results/ckpt_hash.json]

Cases: a plain torch.save; save_hashed (every buffer hashed as it is written); hash_file (the read a resume's
verification makes); the standard library's hashes over bytes in memory.
The state is fp32 tensors of 4 MiB each (an AdamW moment's shape of a mid-size layer), written to --dir
(default: a temporary folder on the disk the runs use). Each case is timed --repeat times; the JSON keeps
every time, the median and the min, the machine's CPU model and the 1-minute load average before and after
(on a shared machine the numbers are only comparable at a similar load). Writes go to the page cache and are
fsynced, as a checkpoint's are.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch

from bench.run import loadavg, versions
from trainfit.train.ckpt_manifest import hash_file, save_hashed

MiB = 2 ** 20


def _plain_save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _timed(cases: dict, repeat: int) -> dict:
    """Each case timed `repeat` times, round robin (a shared machine's load drifts: every case sees it alike)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeat):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: {"seconds": ts, "median_s": statistics.median(ts), "min_s": min(ts)} for name, ts in times.items()}


def _hash_only(data: memoryview, algo: str) -> None:
    if algo == "crc32":
        v = 0
        for i in range(0, len(data), 4 * MiB):
            v = zlib.crc32(data[i:i + 4 * MiB], v)
        return
    h = hashlib.new(algo)
    for i in range(0, len(data), 4 * MiB):
        h.update(data[i:i + 4 * MiB])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default="bench/results/ckpt_hash.json")
    a = ap.parse_args()
    state = {f"t{i}": torch.randn(MiB) for i in range(a.mib // 4)}   # 4 MiB fp32 tensors
    size = sum(t.numel() * 4 for t in state.values())
    load_before = loadavg()
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        plain, hashed = Path(d) / "plain.pt", Path(d) / "hashed.pt"
        cases = _timed({"torch.save": lambda: _plain_save(state, plain),
                        "torch.save hashed (save_hashed)": lambda: save_hashed(state, hashed),
                        "verify read (hash_file)": lambda: hash_file(hashed)}, a.repeat)
    data = memoryview(os.urandom(min(size, 256 * MiB)))
    hashes = _timed({algo: lambda algo=algo: _hash_only(data, algo) for algo in ("sha256", "blake2b", "md5", "crc32")},
                    a.repeat)
    for c in [*cases.values()]:
        c["gib_per_s"] = size / c["median_s"] / 2 ** 30
    for c in hashes.values():
        c["gib_per_s"] = len(data) / c["median_s"] / 2 ** 30
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    out = {"command": f"python -m bench.ckpt_hash --mib {a.mib} --repeat {a.repeat}", "bytes": size,
           "cpu": cpu, "cores": os.cpu_count(), "load_before": load_before, "load_after": loadavg(),
           "versions": versions(), "cases": cases, "hash_only": hashes,
           "hashing_overhead": cases["torch.save hashed (save_hashed)"]["median_s"] / cases["torch.save"]["median_s"] - 1}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for name, c in {**cases, **hashes}.items():
        print(f"{name:34s} median {c['median_s']:.3f} s  ({c['gib_per_s']:.2f} GiB/s)")
    print(f"hashing while writing costs {100 * out['hashing_overhead']:.0f}% over a plain torch.save; written {a.out}")


if __name__ == "__main__":
    main()
