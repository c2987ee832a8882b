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
    from trainfit.app.serve.policy import load_served_policy

    try:
        policy = load_served_policy(model, adapter=adapter, device=device, dtype=dtype, name=served_model_name)
    except ConfigError as e:
        fail(str(e))
    app = create_app(policy, max_batch=max_batch, batch_wait_ms=batch_wait_ms, api_key=api_key)
    adapters = f" + adapters {', '.join(policy.adapters)}" if policy.adapters else ""
    console.print(f"serving {policy.name!r} (from {policy.source}){adapters} at http://{host}:{port}/v1 "
                  f"(max batch {max_batch}, wait {batch_wait_ms:g} ms)", highlight=False, soft_wrap=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
