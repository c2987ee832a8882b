"""What was alive at the peak of a CUDA memory snapshot (bench/gpu_snapshot.py), grouped by where it
was allocated: the reading that tells which of the planner's components is short.

    python -m bench.snapshot_peak snapshot-CASE.pickle.gz [--top 25] [--json out.json]

The snapshot's `device_traces` hold the allocator's events in order (alloc, free_requested,
free_completed, segment_*), each with its size and Python frames. Replaying the allocs and frees
gives the allocated bytes after every event; the peak is the largest, and the blocks alive at that
moment are grouped by their allocation site: the innermost frame in trainfit/, else the innermost
in a library that allocated it (transformers, peft, bitsandbytes, liger, torch). Events older than
the trace's window (MAX_ENTRIES) are not in it: blocks allocated before the window began (the
weights, usually) show up as `before the trace` from the snapshot's segments.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import sys
from collections import defaultdict
from pathlib import Path

LIBS = ("trainfit/", "transformers/", "peft/", "bitsandbytes/", "liger_kernel/", "deepspeed/", "torch/")


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def site(frames: list[dict]) -> str:
    """`file:line function` of the innermost frame in trainfit, else in a known library, else the first."""
    for prefix in LIBS:
        for fr in frames or []:
            name = fr.get("filename", "")
            if prefix in name:
                short = name[name.index(prefix):]
                return f"{short}:{fr.get('line')} {fr.get('name')}"
    fr = (frames or [{}])[0]
    return f"{fr.get('filename', '?')}:{fr.get('line', '?')} {fr.get('name', '?')}"


def peak(snapshot: dict, device: int = 0) -> dict:
    """The peak of allocated bytes within the trace and what was alive then, by allocation site."""
    events = snapshot.get("device_traces", [[]])[device]
    # Blocks alive when the dump was taken but allocated before the trace window: count them as a base.
    traced = {e["addr"] for e in events if e.get("action") == "alloc"}
    base = sum(b["size"] for seg in snapshot.get("segments", []) if seg.get("device", 0) == device
               for b in seg.get("blocks", []) if b.get("state") == "active_allocated" and b["address"] not in traced)
    live: dict[int, tuple[int, str]] = {}
    now = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for e in events:
        act = e.get("action")
        if act == "alloc":
            live[e["addr"]] = (e["size"], site(e.get("frames", [])))
            now += e["size"]
            if now > best:
                best, best_live = now, dict(live)
        elif act in ("free_requested", "free") and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    by_site: dict[str, int] = defaultdict(int)
    for size, where in best_live.values():
        by_site[where] += size
    return {"peak_traced_bytes": best, "before_trace_bytes": base, "peak_bytes": best + base,
            "sites": sorted(by_site.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    res = peak(load(Path(args.snapshot)))
    gib = 2 ** 30
    print(f"peak {res['peak_bytes'] / gib:.3f} GiB = {res['before_trace_bytes'] / gib:.3f} allocated before the "
          f"trace + {res['peak_traced_bytes'] / gib:.3f} within it; alive at the peak, by allocation site:")
    for where, size in res["sites"][:args.top]:
        print(f"  {size / gib:8.3f} GiB  {where}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
