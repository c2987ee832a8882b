"""An environment service that restarts in the middle of a GRPO run: the run goes on and ends where an
uninterrupted run ends.

    .venv/bin/python -m bench.remote_restart [--steps 3] [--restart-at 5] [--down-s 1.0]
                                             [--out bench/results/remote_restart.json]

GRPO on preset:tiny (train.device=cpu) against a small HTTP environment service on 127.0.0.1 (one turn:
/reset shows the arithmetic prompt, /step scores the reply by its text's bytes modulo 5, so that the
random-init policy's rewards differ within a group and every step changes the weights). The same run
twice:
- uninterrupted;
- restarted: at the service's --restart-at-th /step it "crashes" (drops that request's connection,
  forgets every episode, stops listening for --down-s seconds) and comes back on the same port.
The client retries the refused requests until the service is back, its 404s for the episodes the
restart lost mark their groups lost, and those groups are sampled again whole with their seeds
(trainfit/envs/groups.py). Recorded: each run's per-step loss, reward, grad norm and env_failed, the final
weights' sha256, whether they are equal, and what the service saw (resets, steps, restarts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench.run import loadavg, machine, versions

ROOT = Path(__file__).resolve().parents[1]


class Service:
    """The one-turn arithmetic environment; `restart_at` > 0 crashes it once at that /step."""

    def __init__(self, restart_at: int = 0, down_s: float = 1.0):
        self.restart_at, self.down_s = restart_at, down_s
        self.episodes: dict[str, str] = {}
        self.counts = {"reset": 0, "step": 0, "lost_404": 0, "restarts": 0}
        self.lock = threading.Lock()
        self.port = 0
        self._start()

    def _start(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                outer.handle(self, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def _crash(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        time.sleep(self.down_s)
        self._start()

    def handle(self, h: BaseHTTPRequestHandler, body: dict) -> None:
        with self.lock:
            if h.path == "/step":
                self.counts["step"] += 1
                if self.counts["step"] == self.restart_at:
                    self.counts["restarts"] += 1
                    self.episodes.clear()
                    threading.Thread(target=self._crash, daemon=True).start()
                    h.close_connection = True
                    h.connection.shutdown(socket.SHUT_RDWR)
                    return
            status, reply = self.answer(h.path, body)
        data = json.dumps(reply).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        if path == "/reset":
            self.counts["reset"] += 1
            eid = f"e{self.counts['reset']}"
            self.episodes[eid] = str(body["task"]["answer"])
            return 200, {"episode_id": eid, "observation": [{"role": "user", "content": body["task"]["prompt"]}]}
        if path == "/step":
            answer = self.episodes.get(body["episode_id"])
            if answer is None:
                self.counts["lost_404"] += 1
                return 404, {"error": f"no episode {body['episode_id']}"}
            return 200, {"observation": [], "reward": sum(body["action"].encode()) % 5 / 4, "done": True}
        return 200, {}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def run(work: Path, name: str, steps: int, service: Service) -> dict:
    run_dir = work / name
    cfg = work / f"{name}.yaml"
    cfg.write_text("stage: grpo\n")
    args = [sys.executable, "-m", "trainfit.app.cli", "train", str(cfg), "model.name=preset:tiny",
            "task.name=arithmetic", "task.max_operand=9", "task.num_eval=0", "env.type=http",
            f"env.url=http://127.0.0.1:{service.port}", "env.timeout_s=10", "env.backoff_s=0.05",
            "env.retry_max_s=60", "rollout.max_new_tokens=4", "train.device=cpu", f"train.max_steps={steps}",
            "train.global_batch_size=8", "train.micro_batch_size=8", "grpo.num_generations=4", "train.lr=1e-3",
            "train.save_every=0", "logging.progress=false", "logging.report_to=none", f"run_dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t = time.monotonic()
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if p.returncode == 0 else []
    train = [r for r in rows if r.get("kind") == "train"]
    weights = sorted(run_dir.rglob("*.safetensors"))
    return {"exit": p.returncode, "seconds": round(time.monotonic() - t, 1), "stderr_tail": p.stderr[-2000:],
            "loss": [r.get("loss") for r in train], "reward": [r.get("reward") for r in train],
            "env_failed": [r.get("env_failed") for r in train], "grad_norm": [r.get("grad_norm") for r in train],
            "weights_sha256": {str(w.relative_to(run_dir)): hashlib.sha256(w.read_bytes()).hexdigest()
                               for w in weights},
            "service": dict(service.counts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--restart-at", type=int, default=13, help="the service crashes at this /step (of 8 a step)")
    ap.add_argument("--down-s", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/remote_restart.json"))
    args = ap.parse_args()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "versions": versions(), "steps": args.steps, "restart_at_step_request": args.restart_at,
              "down_s": args.down_s, "loadavg_start": loadavg()}
    with tempfile.TemporaryDirectory(prefix="remote_restart-") as tmp:
        for name, restart_at in (("uninterrupted", 0), ("restarted", args.restart_at)):
            service = Service(restart_at, args.down_s)
            try:
                result[name] = run(Path(tmp), name, args.steps, service)
            finally:
                service.close()
    a, b = result["uninterrupted"], result["restarted"]
    result["checks"] = {"both_finished": a["exit"] == b["exit"] == 0,
                        "service_restarted": b["service"]["restarts"] == 1,
                        "episodes_lost_and_sampled_again": b["service"]["lost_404"] > 0
                        and b["service"]["reset"] > a["service"]["reset"],
                        "no_episode_failed": all(not x for x in b["env_failed"]),
                        "every_step_trained": all(g and g > 0 for g in a["grad_norm"]),
                        "same_losses_and_rewards": (a["loss"], a["reward"]) == (b["loss"], b["reward"]),
                        "same_weights": bool(a["weights_sha256"]) and a["weights_sha256"] == b["weights_sha256"]}
    result["loadavg_end"] = loadavg()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"checks": result["checks"], "service": {"uninterrupted": a["service"], "restarted": b["service"]},
                      "loss": [a["loss"], b["loss"]], "seconds": [a["seconds"], b["seconds"]]}, indent=1))


if __name__ == "__main__":
    main()
