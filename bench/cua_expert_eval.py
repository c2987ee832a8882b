"""Success of the MiniWoB++ DOM expert (trainfit/envs/miniwob_expert.py) per task, on unseen seeds.

    PYTHONPATH=. .venv/bin/python -m bench.cua_expert_eval                       # every task below, 20 seeds
    PYTHONPATH=. .venv/bin/python -m bench.cua_expert_eval --tasks login-user,choose-list --seeds 50

Each episode is played through the environment service's own logic (MiniWoBService: the same parsing,
browser, settled screenshots and reward a policy gets; only the HTTP transport is left out), asking the
service's /expert for each action until MiniWoB ends the episode. The seeds are evaluation instances 0..N-1
(split "eval": MiniWoB seeds 1,000,000 and up in its "test" data mode); the expert was written on
training instances 0-3 (--split train), and one rule (aim past a covering control) came from evaluation
instance 20 of click-test-2. A task counts as solved on an episode MiniWoB rewarded 1. Tasks the expert cannot act on are
run too: their rows carry the expert's stated reason. Writes bench/results/cua_expert.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from trainfit.envs.miniwob_browser import BrowserPool
from trainfit.envs.miniwob_expert import SOLVED
from trainfit.envs.miniwob_service import MiniWoBService

# Tasks the expert declines or gets wrong, reported with the reason it gives.
UNSOLVED = ("click-scroll-list", "click-checkboxes-soft", "identify-shape", "use-autocomplete", "click-tab-2")
OUT = Path(__file__).resolve().parent / "results" / "cua_expert.json"


def play(service: MiniWoBService, task: str, seed: int, max_steps: int, split: str = "eval") -> dict:
    """One evaluation episode of the expert: success, steps, and why it stopped when it did not succeed."""
    eid = service.reset({"miniwob_task": task, "seed": seed, "split": split})["episode_id"]
    try:
        for step in range(1, max_steps + 1):
            advice = service.expert({"episode_id": eid})
            if advice["action"] is None:
                return {"success": False, "steps": step - 1, "why": advice["why"]}
            code, reply = service.step({"episode_id": eid, "step": step, "action": advice["action"]})
            if code != 200:
                return {"success": False, "steps": step, "why": f"HTTP {code}: {reply.get('error', '')[:200]}"}
            if reply["done"]:
                ok = bool(reply["info"].get("success"))
                return {"success": ok, "steps": step,
                        "why": "" if ok else f"MiniWoB ended the episode with reward {reply['reward']:g}"}
        return {"success": False, "steps": max_steps, "why": f"not done after {max_steps} actions"}
    finally:
        service.close({"episode_id": eid})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.cua_expert_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=",".join(SOLVED + UNSOLVED), help="comma-separated MiniWoB++ tasks")
    ap.add_argument("--seeds", type=int, default=20, help="evaluation instances 0..N-1 per task")
    ap.add_argument("--max-steps", type=int, default=12, help="actions before an episode counts as failed")
    ap.add_argument("--split", default="eval", choices=("eval", "train"),
                    help="eval: the unseen instances reported; train: the instances to develop on")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    service = MiniWoBService(tasks, BrowserPool(1), episode_timeout_s=600)
    started, rows = time.monotonic(), {}
    try:
        for task in tasks:
            eps = [play(service, task, s, args.max_steps, args.split) for s in range(args.seeds)]
            wins = sum(e["success"] for e in eps)
            reasons = collections.Counter(e["why"] for e in eps if not e["success"])
            rows[task] = {"episodes": len(eps), "success": wins, "rate": wins / len(eps),
                          "mean_steps": sum(e["steps"] for e in eps) / len(eps),
                          "failures": [{"why": w, "episodes": n} for w, n in reasons.most_common(3)]}
            print(f"{task:24s} {wins:3d}/{len(eps)}  {reasons.most_common(1)[0][0][:100] if reasons else ''}",
                  flush=True)
    finally:
        service.pool.close()
    report = {"seeds": f"instances 0-{args.seeds - 1} of split {args.split}", "max_steps": args.max_steps,
              "seconds": round(time.monotonic() - started, 1), "tasks": rows,
              "solved_tasks": sorted(t for t, r in rows.items() if r["rate"] == 1.0)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{len(report['solved_tasks'])} of {len(rows)} tasks solved on every seed; wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
