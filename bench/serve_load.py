"""`trainfit serve` under load on 127.0.0.1: latency, throughput, what overload and bad clients get.

    .venv/bin/python -m bench.serve_load [--model preset:tiny] [--seconds 15] [--max-queue 32]
                                         [--out bench/results/serve_load.json]

Starts `trainfit serve MODEL --device cpu` (a subprocess, as a user runs it) with small limits, then runs
two phases of concurrent clients (asyncio sockets, one connection per request, each completion 8 tokens
of a short token-id prompt with its own seed):
- `within`: max_queue / 2 clients, one request each at a time: the latency and throughput the server
  gives when it is not overloaded (no 503 expected);
- `overload`: 4 x max_queue clients plus, mixed in, slow clients (slowloris: a head sent a byte every
  0.5 s, and a head with a body that stops), malformed requests (a junk request line, conflicting
  Content-Length), and oversized ones (a body over --max-body-mb, a 70 KB header). Clients answered 503
  wait the Retry-After they are given, as a well-behaved client does.
Recorded per phase and kind: status counts, p50 / p99 latency (of every reply, of the 200s, of the 503s),
completions a second; the server's deepest queue (GET /health) against its limit; that it answered
/health after the load (alive). The machine, its load average and the commit go with the numbers:
on a shared machine they are only comparable at a similar load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.run import loadavg, machine, versions

ROOT = Path(__file__).resolve().parents[1]
SLOW_BYTE_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def exchange(port: int, data: bytes, trickle: float = 0.0, timeout: float = 60.0) -> tuple[int, dict, bytes]:
    """Send `data` (one byte every `trickle` s when set) on a new connection; (status, headers, body) of
    the reply, status 0 when the server closed without one."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return 0, {}, b""
    read = asyncio.ensure_future(asyncio.wait_for(reader.read(), timeout))
    try:
        if trickle:
            for i in range(len(data)):
                if read.done():     # answered (408) before the head was done
                    break
                writer.write(data[i:i + 1])
                await writer.drain()
                await asyncio.sleep(trickle)
        else:
            writer.write(data)
            await writer.drain()
    except ConnectionError:         # the server answered and closed while we were still sending
        pass
    try:
        raw = await read
    except (ConnectionError, asyncio.TimeoutError):
        raw = b""
    finally:
        writer.close()
    if not raw:
        return 0, {}, b""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def completion(seed: int) -> bytes:
    body = json.dumps({"prompt": [19, 13, 20, 31], "max_tokens": 8, "seed": seed}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


BAD = {   # kind -> (request bytes, trickle seconds a byte)
    "slow_head": (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 40\r\n\r\n", SLOW_BYTE_S),
    "slow_body": (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Length: 400\r\n\r\n{\"prompt\": [1", 0.0),
    "junk_line": (b"HELLO THERE WORLD\r\n\r\n", 0.0),
    "two_lengths": (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
                    0.0),
    "oversized_body": (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Length: %d\r\n\r\n" % (2 << 20)
                       + b"x" * (2 << 20), 0.0),
    "huge_header": (b"GET /health HTTP/1.1\r\nHost: bench\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 0.0),
}


class Record:
    def __init__(self):
        self.replies: dict[str, list[tuple[int, float]]] = {}

    def add(self, kind: str, status: int, seconds: float) -> None:
        self.replies.setdefault(kind, []).append((status, seconds))

    def summary(self, seconds: float) -> dict:
        out = {}
        for kind, rows in sorted(self.replies.items()):
            counts: dict[str, int] = {}
            for s, _ in rows:
                counts[str(s)] = counts.get(str(s), 0) + 1
            every = [t for _, t in rows]
            ok = [t for s, t in rows if s == 200]
            out[kind] = {"requests": len(rows), "status": counts, "latency_s": quantiles(every),
                         "latency_200_s": quantiles(ok), "latency_503_s": quantiles([t for s, t in rows if s == 503]),
                         "per_s_200": round(len(ok) / seconds, 2)}
        return out


def quantiles(values: list[float]) -> dict | None:
    if not values:
        return None
    v = sorted(values)
    return {"p50": round(statistics.median(v), 4), "p99": round(v[min(len(v) - 1, int(0.99 * len(v)))], 4),
            "max": round(v[-1], 4)}


async def client(port: int, rec: Record, stop: float, seeds) -> None:
    while time.monotonic() < stop:
        t = time.monotonic()
        status, headers, _ = await exchange(port, completion(next(seeds)))
        rec.add("completion", status, time.monotonic() - t)
        if status == 503:   # come back when told
            await asyncio.sleep(float(headers.get("retry-after", 1)))


async def bad_client(port: int, rec: Record, stop: float, kinds: list[str], rng: random.Random) -> None:
    while time.monotonic() < stop:
        kind = rng.choice(kinds)
        data, trickle = BAD[kind]
        t = time.monotonic()
        status, _, _ = await exchange(port, data, trickle)
        rec.add(kind, status, time.monotonic() - t)
        await asyncio.sleep(0.05)


async def phase(port: int, clients: int, bad: int, seconds: float, seed: int) -> dict:
    rec, rng = Record(), random.Random(seed)
    seeds = iter(range(seed * 1_000_000, (seed + 1) * 1_000_000))
    stop = time.monotonic() + seconds
    start = time.monotonic()
    await asyncio.gather(*[client(port, rec, stop, seeds) for _ in range(clients)],
                         *[bad_client(port, rec, stop, list(BAD), rng) for _ in range(bad)])
    return {"clients": clients, "bad_clients": bad, "seconds": round(time.monotonic() - start, 2),
            "by_kind": rec.summary(seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:tiny")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--max-queue", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--read-timeout-s", type=float, default=2.0)
    ap.add_argument("--max-body-mb", type=float, default=1.0)
    ap.add_argument("--bad-clients", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/serve_load.json"))
    args = ap.parse_args()

    port = free_port()
    flags = ["--max-queue", str(args.max_queue), "--max-batch", str(args.max_batch), "--read-timeout-s",
             str(args.read_timeout_s), "--max-body-mb", str(args.max_body_mb), "--max-connections", "1024"]
    log = open(Path(tempfile.mkdtemp(prefix="serve_load-")) / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "trainfit.app.cli", "serve", args.model, "--device", "cpu",
                             "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    health = f"http://127.0.0.1:{port}/health"
    try:
        for _ in range(600):
            try:
                if httpx.get(health, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise SystemExit(f"the server did not start; see {log.name}")
        result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                  "versions": versions(), "model": args.model, "server_flags": flags, "seed": args.seed,
                  "loadavg_start": loadavg()}
        result["within"] = asyncio.run(phase(port, max(1, args.max_queue // 2), 0, args.seconds, args.seed))
        result["within"]["queue"] = httpx.get(health, timeout=10).json()["queue"]
        result["overload"] = asyncio.run(phase(port, 4 * args.max_queue, args.bad_clients, args.seconds,
                                               args.seed + 1))
        after = httpx.get(health, timeout=10)
        result["after"] = {"health_status": after.status_code, "queue": after.json().get("queue"),
                           "server_alive": proc.poll() is None}
        result["loadavg_end"] = loadavg()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    q = result["after"]["queue"]
    result["checks"] = {"queue_bounded": q["max_depth"] <= q["limit"], "alive": result["after"]["server_alive"],
                        "no_5xx_but_503": all(not (k.startswith("5") and k != "503")
                                              for ph in ("within", "overload")
                                              for kind in result[ph]["by_kind"].values() for k in kind["status"])}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({ph: {k: {"status": v["status"], "latency_s": v["latency_s"], "per_s_200": v["per_s_200"]}
                           for k, v in result[ph]["by_kind"].items()} for ph in ("within", "overload")}, indent=1))
    print(json.dumps({"queue": q, "checks": result["checks"]}))


if __name__ == "__main__":
    main()
