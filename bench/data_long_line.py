"""`trainfit data` and `trainfit train --dry-run` on a JSONL file of one 50 MB line: peak memory and wall time.

    .venv/bin/python -m bench.data_long_line [--mb 50] [--out bench/results/data_long_line.json]

The line is one SFT row whose answer is 50 MB of words, written as prompt/completion and as chat messages
(preset:tiny's tokenizer, data.max_seq_length=512, on the CPU); a file of one short row is measured first, for
what the commands cost without a long line (imports, the tokenizer). Each command runs in a fresh process, imports
included, as a user would run it; its peak RSS is that process's own (os.wait4's ru_maxrss) and its CPU seconds
are recorded beside the wall time, since a shared machine's load stretches the latter. The goal (issue 50): under
1 GB of RSS and an answer in seconds, with `data` saying that the row was cut and which row it is.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """model:
  name: preset:tiny
data:
  path: {path}
  max_seq_length: 512
  eval_fraction: 0.0
task:
  name: null
train:
  device: cpu
  global_batch_size: 4
  micro_batch_size: 4
  max_steps: 1
run_dir: {run}
logging:
  tensorboard: false
  progress: false
  plot: false
"""
WORDS = ("the model reads each row of the file and keeps what fits in its context window while the rest is "
         "cut away before any token is made so that one long answer costs little memory").split()


def long_text(mb: int, seed: int = 0) -> str:
    """`mb` MiB of words: a seeded 1 MiB block of them, repeated."""
    rng = random.Random(seed)
    block, size = [], 0
    while size < 2 ** 20:
        w = rng.choice(WORDS)
        block.append(w)
        size += len(w) + 1
    return (" ".join(block) + " ") * mb


def run(cmd: list[str]) -> dict:
    """Run `cmd`; its exit code, wall and CPU seconds, peak RSS (MiB) and output."""
    t = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        out.seek(0)
        text = out.read().decode("utf-8", "replace")
    return {"exit_code": os.waitstatus_to_exitcode(status), "wall_s": round(wall, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024),
            "output": text}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "data_long_line.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainfit-long-line-"))
    text = long_text(args.mb)
    # A short row first: what the commands cost without a long line (imports, the tokenizer), to compare with.
    rows = {"short_row": {"prompt": "Summarise the notes below.", "completion": " ".join(WORDS)},
            "prompt_completion": {"prompt": "Summarise the notes below.", "completion": text},
            "messages": {"messages": [{"role": "user", "content": "Summarise the notes below."},
                                      {"role": "assistant", "content": text}]}}
    del text
    cases = []
    for layout, row in rows.items():
        path = tmp / f"{layout}.jsonl"
        path.write_text(json.dumps(row) + "\n")
        cfg = tmp / f"{layout}.yaml"
        cfg.write_text(CONFIG.format(path=path, run=tmp / f"run-{layout}"))
        line_mib = round(path.stat().st_size / 2 ** 20, 1)
        for name, argv in (("data", ["data", str(cfg), "--rows", "1"]),
                           ("train --dry-run", ["train", str(cfg), "--dry-run"])):
            res = run([sys.executable, "-m", "trainfit.app.cli", *argv])
            out = " ".join(res.pop("output").split())
            said = "are cut there" in out and f"{path.name}, line 1" in out
            cases.append({"layout": layout, "command": f"trainfit {name}", "line_mib": line_mib, **res,
                          **({"says_cut_and_where": said} if name == "data" and layout != "short_row" else {}),
                          **({"output_tail": out[-600:]} if res["exit_code"] else {})})
            print(json.dumps(cases[-1]), flush=True)
    result = {"what": f"one JSONL line of {args.mb} MiB (an SFT answer), data.max_seq_length=512, preset:tiny, CPU",
              "goal": "peak RSS under 1024 MiB, an answer in seconds, `data` says the row was cut and where",
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "load_average_1min": round(os.getloadavg()[0], 1),
              "max_peak_rss_mib": max(c["peak_rss_mib"] for c in cases),
              "all_under_1gib": all(c["peak_rss_mib"] < 1024 and c["exit_code"] == 0 for c in cases),
              "cases": cases}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}, indent=2))


if __name__ == "__main__":
    main()
