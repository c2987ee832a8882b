"""A remote part that restarts in the middle of a GRPO run: the run goes on and ends where an
uninterrupted run ends.

    .venv/bin/python -m bench.remote_restart [--part env|openai|both] [--steps 3] [--restart-at 13]
                                             [--down-s 1.0] [--out bench/results/remote_restart.json]

Part `env`:
GRPO on preset:tiny (train.device=cpu) against a small HTTP environment service on 127.0.0.1 (one turn:
/reset shows the arithmetic prompt, /step scores the reply by its text's bytes modulo 5, so that the
random-init policy's rewards differ within a group and every step changes the weights). The same run
twice:
- uninterrupted;
- restarted: at the service's --restart-at-th /step it "crashes" (drops that request's connection,
  forgets every episode, stops listening for --down-s seconds) and comes back on the same port.
The client retries the refused requests until the service is back, its 404s for the episodes the
restart lost mark their groups lost, and those groups are sampled again whole with their seeds
(trainfit/envs/groups.py).

Part `openai`: GRPO of a LoRA on preset:tiny (saved as a base) whose rollouts `trainfit serve` samples
(rollout.engine=openai), rewarded by the same text score, twice: uninterrupted, and with the server
killed (SIGKILL) as soon as step 1 is logged and started again on its port --down-s later. The engine's
requests (the next adapter push, or the completions) are retried until it is back; an adapter the new
server lacks is loaded again from rollout.sync_dir.

Recorded for each: each run's per-step loss, reward, grad norm (and env_failed), the final weights'
sha256, whether they are equal, and what the service saw (resets, steps, restarts) or what the trainer
said about the restart.
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
from bench.serve_load import free_port

ROOT = Path(__file__).resolve().parents[1]
PY_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def text_score(prompts, completions, **fields) -> list[float]:
    """A reward that differs within a group for a random-init policy: the reply's bytes modulo 5, over 4."""
    return [sum(c.encode()) % 5 / 4 for c in completions]


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
            return 200, {"observation": [], "reward": text_score([None], [body["action"]])[0], "done": True}
        return 200, {}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def train(work: Path, name: str, steps: int, overrides: list[str]) -> dict:
    """`trainfit train` of GRPO on CPU with `overrides`; its exit, seconds, per-step figures and weights."""
    run_dir = work / name
    cfg = work / f"{name}.yaml"
    cfg.write_text("stage: grpo\n")
    args = [sys.executable, "-m", "trainfit.app.cli", "train", str(cfg), "task.name=arithmetic", "task.max_operand=9",
            "task.num_eval=0", "rollout.max_new_tokens=4", "train.device=cpu", f"train.max_steps={steps}",
            "train.global_batch_size=8", "train.micro_batch_size=8", "grpo.num_generations=4", "train.lr=1e-3",
            "train.save_every=0", "logging.progress=false", "logging.report_to=none", f"run_dir={run_dir}", *overrides]
    t = time.monotonic()
    p = subprocess.run(args, cwd=ROOT, env=PY_ENV, capture_output=True, text=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if p.returncode == 0 else []
    steps_ = [r for r in rows if r.get("kind") == "train"]
    weights = sorted(run_dir.rglob("final/*.safetensors"))
    return {"exit": p.returncode, "seconds": round(time.monotonic() - t, 1), "stderr_tail": p.stderr[-2000:],
            "loss": [r.get("loss") for r in steps_], "reward": [r.get("reward") for r in steps_],
            "env_failed": [r.get("env_failed") for r in steps_], "grad_norm": [r.get("grad_norm") for r in steps_],
            "weights_sha256": {str(w.relative_to(run_dir)): hashlib.sha256(w.read_bytes()).hexdigest()
                               for w in weights}}


def env_part(work: Path, args) -> dict:
    out = {}
    for name, restart_at in (("uninterrupted", 0), ("restarted", args.restart_at)):
        service = Service(restart_at, args.down_s)
        try:
            out[name] = train(work, f"env-{name}", args.steps, [
                "model.name=preset:tiny", "env.type=http", f"env.url=http://127.0.0.1:{service.port}",
                "env.timeout_s=10", "env.backoff_s=0.05", "env.retry_max_s=60"])
        finally:
            service.close()
        out[name]["service"] = dict(service.counts)
    a, b = out["uninterrupted"], out["restarted"]
    out["checks"] = {**same(a, b), "service_restarted": b["service"]["restarts"] == 1,
                     "episodes_lost_and_sampled_again": b["service"]["lost_404"] > 0
                     and b["service"]["reset"] > a["service"]["reset"],
                     "no_episode_failed": all(not x for x in b["env_failed"])}
    return out


def same(a: dict, b: dict) -> dict:
    return {"both_finished": a["exit"] == b["exit"] == 0,
            "every_step_trained": bool(a["grad_norm"]) and all(g and g > 0 for g in a["grad_norm"]),
            "same_losses_and_rewards": (a["loss"], a["reward"]) == (b["loss"], b["reward"]),
            "same_weights": bool(a["weights_sha256"]) and a["weights_sha256"] == b["weights_sha256"]}


def serve(base: Path, port: int, log) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "trainfit.app.cli", "serve", str(base), "--port", str(port),
                             "--device", "cpu", "--batch-wait-ms", "20"], cwd=ROOT, env=PY_ENV, stdout=log,
                            stderr=subprocess.STDOUT)
    import httpx

    for _ in range(1500):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"trainfit serve did not start; see {log.name}")


def openai_part(work: Path, args) -> dict:
    from trainfit.config import ModelConfig, PeftConfig
    from trainfit.models.policy import load_policy
    from trainfit.models.save import save_pretrained

    import torch

    base = work / "base"
    save_pretrained(load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu")), base)
    out = {}
    for name in ("uninterrupted", "restarted"):
        port = free_port()
        log = open(work / f"serve-{name}.log", "w")
        procs = [serve(base, port, log)]
        restarted = threading.Event()

        def restart_after_step_1():
            metrics = work / f"openai-{name}" / "metrics.jsonl"
            while not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
                time.sleep(0.05)
            procs[0].kill()
            procs[0].wait()
            time.sleep(args.down_s)
            procs.append(serve(base, port, log))
            restarted.set()
        if name == "restarted":
            threading.Thread(target=restart_after_step_1, daemon=True).start()
        try:
            out[name] = train(work, f"openai-{name}", args.steps, [
                f"model.name={base}", "peft.method=lora", "peft.r=4", "rollout.engine=openai",
                f"rollout.base_url=http://127.0.0.1:{port}/v1", "rollout.retry_backoff_s=0.2", "rollout.request_retries=30",
                f"task.rewards=[{Path(__file__).resolve()}:text_score]", "rollout.sync_tolerance=1e-3"])
        finally:
            for p in procs:
                p.kill()
                p.wait()
            log.close()
        out[name]["server_restarted"] = restarted.is_set()
    a, b = out["uninterrupted"], out["restarted"]
    out["checks"] = {**same(a, b), "server_restarted": b["server_restarted"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["env", "openai", "both"], default="both")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--restart-at", type=int, default=13, help="env: the service crashes at this /step (8 a step)")
    ap.add_argument("--down-s", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/remote_restart.json"))
    args = ap.parse_args()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "versions": versions(), "steps": args.steps, "restart_at_step_request": args.restart_at,
              "down_s": args.down_s, "loadavg_start": loadavg()}
    with tempfile.TemporaryDirectory(prefix="remote_restart-") as tmp:
        for part, fn in (("env", env_part), ("openai", openai_part)):
            if args.part in (part, "both"):
                result[part] = fn(Path(tmp), args)
                print(json.dumps({part: result[part]["checks"]}))
    result["loadavg_end"] = loadavg()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
