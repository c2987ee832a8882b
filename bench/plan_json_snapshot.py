"""`trainfit plan --json` of every example, saved byte for byte, to show a refactor changed no plan.

    python bench/plan_json_snapshot.py save DIR      # one file per example: exit code, stdout, stderr
    python bench/plan_json_snapshot.py compare A B   # byte-identical or the examples that differ

The checkout's own path is written as <checkout>. Each example is planned in a fresh process with an empty planner cache (so the traces are run, not
read back) and offline (HF_HUB_OFFLINE=1), as a user without network would plan it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _plan(example: Path) -> str:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRAINFIT_CACHE=cache, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                   COLUMNS="200", NO_COLOR="1")
        proc = subprocess.run([sys.executable, "-m", "trainfit.app.cli", "plan", str(example.relative_to(ROOT)), "--json"],
                              cwd=ROOT, env=env, capture_output=True, text=True)
    text = f"exit {proc.returncode}\n--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}"
    return text.replace(str(ROOT), "<checkout>")   # notes name local paths: two checkouts compare equal


def save(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        text = _plan(example)
        (out / f"{example.stem}.txt").write_text(text)
        print(f"{example.name}: {text.splitlines()[0]}", flush=True)


def compare(a: Path, b: Path) -> int:
    names = sorted({p.name for p in a.glob("*.txt")} | {p.name for p in b.glob("*.txt")})
    differ = [n for n in names if not ((a / n).exists() and (b / n).exists()
                                       and (a / n).read_bytes() == (b / n).read_bytes())]
    for n in names:
        print(f"{n}: {'DIFFERS' if n in differ else 'identical'}")
    print(f"{len(names) - len(differ)} of {len(names)} examples byte-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["save"] and len(sys.argv) == 3:
        save(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
