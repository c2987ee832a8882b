"""`trainfit serve`: registered on the CLI app by trainfit.app.cli."""

from __future__ import annotations

import os
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)


def serve_command(
    model: str = typer.Argument(..., help=(
        "What to serve: a hub id, a local model or adapter directory, a preset (preset:tiny), a finished trainfit "
        "run directory (its last stage's final model), or a checkpoint directory (checkpoints/step-N).")),
    adapter: Optional[str] = typer.Option(None, "--adapter", help=(
        "A LoRA adapter directory to load on top, as PATH or NAME=PATH (served under NAME, default the "
        "directory's name).")),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (0.0.0.0 = all)."),
    max_batch: int = typer.Option(32, "--max-batch", min=1, help="Sequences generated together at most."),
    batch_wait_ms: float = typer.Option(10.0, "--batch-wait-ms", min=0.0, help=(
        "How long the first request of a batch waits for others to join it.")),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, or auto (cuda when visible)."),
    dtype: str = typer.Option("auto", "--dtype", help="fp32, bf16, fp16, or auto (bf16 on cuda, fp32 on cpu)."),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", help=(
        "Environment variable holding an API key; when set, /v1 requests need `Authorization: Bearer <key>`.")),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help=(
        "The base model's name in the API (default: MODEL as given).")),
    max_queue: int = typer.Option(256, "--max-queue", min=1, help=(
        "Sequences (prompts x n) waiting for or in generation at most; past it a request is answered 503 with "
        "Retry-After, never queued.")),
    max_connections: int = typer.Option(1024, "--max-connections", min=1, help=(
        "Open connections at most; one more is answered 503 with Retry-After and closed.")),
    read_timeout_s: float = typer.Option(10.0, "--read-timeout-s", min=0.01, help=(
        "Seconds a request's head may take from its first byte, and its body after the head (slow clients: 408).")),
    max_body_mb: float = typer.Option(16.0, "--max-body-mb", min=0.001, help="Largest request body in MiB (413 past it)."),
) -> None:
    """Serve a policy behind an OpenAI-compatible API (completions, chat, LoRA adapter loading)."""
    from trainfit.app.cli import console, fail
    from trainfit.config import ConfigError

    if device not in ("auto", "cpu", "cuda"):
        fail(f"--device {device!r}: use cpu, cuda or auto.")
    if dtype not in ("auto", "fp32", "bf16", "fp16"):
        fail(f"--dtype {dtype!r}: use fp32, bf16, fp16 or auto.")
    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        console.print(f"note: ${api_key_env} is not set; serving without an API key.", highlight=False)

    import uvicorn

    from trainfit.app.serve.app import create_app
    from trainfit.app.serve.limits import ServeLimits
    from trainfit.app.serve.policy import load_served_policy
    from trainfit.app.serve.server import server_config

    try:
        policy = load_served_policy(model, adapter=adapter, device=device, dtype=dtype, name=served_model_name)
    except ConfigError as e:
        fail(str(e))
    for note in policy.notes:
        console.print(note, highlight=False, soft_wrap=True)
    limits = ServeLimits(max_queue=max_queue, max_connections=max_connections, read_timeout_s=read_timeout_s,
                         max_body_bytes=int(max_body_mb * 1024 * 1024))
    app = create_app(policy, max_batch=max_batch, batch_wait_ms=batch_wait_ms, api_key=api_key, limits=limits)
    adapters = f" + adapters {', '.join(policy.adapters)}" if policy.adapters else ""
    console.print(f"serving {policy.name!r} (from {policy.source}){adapters} at http://{host}:{port}/v1 "
                  f"(max batch {max_batch}, wait {batch_wait_ms:g} ms, queue {max_queue} sequences, "
                  f"{max_connections} connections)", highlight=False, soft_wrap=True)
    uvicorn.Server(server_config(app, host, port, limits)).run()
