"""`bench.run decode-proxy` (part of `make bench`'s `all`): the CPU decoding proxy (bench/decode_proxy.py)
writes its JSON with the CPU's name, both decoding paths and their sync points, and its BENCHMARKS
section. CPU (`train.device=cpu`); no timing is asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# bench/ is a directory of the repository, not part of the installed package: make it importable.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import run as bench_run  # noqa: E402


def test_decode_proxy_runs_in_the_bench(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    bench_run.main(["decode-proxy", "--quick", "--max-load", "0", "--out-dir", str(tmp_path / "results"), "--md", str(md)])
    r = json.loads((tmp_path / "results" / "decode_proxy_cpu.json").read_text())
    assert r["device"] and set(r["paths"]) == {"dynamic", "static"} and set(r["profile"]) == {"dynamic", "static"}
    # The static step reads back once per SYNC_EVERY steps; the dynamic loop several times per step.
    assert r["paths"]["static"]["sync_calls_per_step"] < 1 <= r["paths"]["dynamic"]["sync_calls_per_step"]
    text = md.read_text()
    assert "Decoding loop on CPU" in text and "| static |" in text
