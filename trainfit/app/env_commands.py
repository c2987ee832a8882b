"""`trainfit env serve miniwob`: registered on the CLI app by trainfit.app.cli.

Not inside trainfit/envs/: every CLI start imports this module, and importing anything in that package
runs its __init__, which loads torch (2 s). The service's modules are imported when the command runs.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

import typer

env_app = typer.Typer(add_completion=False, no_args_is_help=True,
                      help="Environment services for multi-turn GRPO (env.type: http).")


def register(app: typer.Typer) -> None:
    app.add_typer(env_app, name="env")


def _checked_tasks(kind: str, tasks: str) -> list[str]:
    """The task names, or exit 2 naming what is missing (browser, package) or unknown."""
    from trainfit.app.cli import fail
    from trainfit.envs.miniwob_browser import MissingDependency, locate_browser, task_names

    if kind != "miniwob":
        fail(f"trainfit env {kind!r}: the environments served are: miniwob.")
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    try:
        locate_browser()
        known = task_names()
    except MissingDependency as e:
        fail(str(e))
    unknown = [t for t in names if t not in known]
    if not names or unknown:
        fail(f"--tasks {tasks!r}: {', '.join(unknown) or 'no task'} is not a MiniWoB++ task; valid names look like "
             f"{', '.join(sorted(known)[:8])}, ... ({len(known)} in all).")
    return names


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@env_app.command("serve")
def serve_command(
    kind: str = typer.Argument(..., help="Which environment: miniwob (MiniWoB++ web tasks on screenshots)."),
    tasks: str = typer.Option("click-button", "--tasks", help=(
        "Comma-separated MiniWoB++ task names (click-button,enter-text,...).")),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="TCP port."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (0.0.0.0 = all)."),
    key: Optional[str] = typer.Option(None, "--key", help=(
        "API key the client must send as `Authorization: Bearer <key>` (the trainer sends the variable named "
        "by env.api_key_env). Prefer --key-env: a key on the command line is visible to other users.")),
    key_env: Optional[str] = typer.Option(None, "--key-env", help="Environment variable holding the API key."),
    pool: int = typer.Option(4, "--pool", min=1, help=(
        "Browsers (headless Chromium) at most; episodes beyond it share them by replaying their actions.")),
    penalty: float = typer.Option(-0.1, "--penalty", help="Reward of a malformed or off-screen action."),
    episode_timeout_s: float = typer.Option(300.0, "--episode-timeout-s", min=1.0, help=(
        "An episode not stepped for this long is closed and its browser freed.")),
) -> None:
    """Serve an environment over trainfit's HTTP environment protocol (/reset, /step, /close)."""
    from trainfit.app.cli import console, fail
    from trainfit.envs.miniwob_browser import BrowserPool
    from trainfit.envs.miniwob_service import MiniWoBService
    from trainfit.envs.service_http import EnvServer

    names = _checked_tasks(kind, tasks)
    if key_env:
        key = os.environ.get(key_env) or fail(f"--key-env {key_env}: the variable is not set; export it with the key.")
    service = MiniWoBService(names, BrowserPool(pool), penalty=penalty, episode_timeout_s=episode_timeout_s)
    try:
        server = EnvServer(service, host=host, port=port, key=key)
    except OSError as e:
        fail(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); choose another port or stop the "
             "process using it.")
    console.print(f"serving MiniWoB++ {', '.join(names)} at {server.url} (pool of {pool} browsers, "
                  f"{'a key' if key else 'no key'}); env.type: http, env.url: {server.url}", highlight=False,
                  soft_wrap=True)
    # SIGTERM (a supervisor, `kill`) ends the service like Ctrl-C: its browsers are closed, not orphaned.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        service.pool.close()


@env_app.command("expert")
def expert_command(
    kind: str = typer.Argument(..., help="Which environment: miniwob."),
    tasks: str = typer.Option("click-button", "--tasks", help="Comma-separated MiniWoB++ task names."),
    seeds: str = typer.Option("0-63", "--seeds", help="Training seeds, e.g. 0-63 or 0-9,20 (never eval seeds)."),
    out: str = typer.Option(..., "--out", help="Folder for rows.jsonl and images/ (an SFT data.path)."),
    pool: int = typer.Option(1, "--pool", min=1, help="Browsers."),
) -> None:
    """Write expert trajectories (successful episodes of a correct agent) as SFT rows with screenshots."""
    from pathlib import Path

    from trainfit.app.cli import console, fail
    from trainfit.envs.miniwob_browser import BrowserPool
    from trainfit.envs.miniwob_expert import SOLVED
    from trainfit.envs.miniwob_rows import parse_seeds, write_expert_rows
    from trainfit.envs.miniwob_service import MiniWoBService

    names = _checked_tasks(kind, tasks)
    missing = [t for t in names if t not in SOLVED]
    if missing:
        fail(f"--tasks: the expert does not solve {', '.join(missing)} (bench/cua_expert_eval.py says why); "
             f"it solves {', '.join(SOLVED)}.")
    try:
        seed_list = parse_seeds(seeds)
    except ValueError as e:
        fail(str(e))
    service = MiniWoBService(names, BrowserPool(pool))
    try:
        path, written, tried = write_expert_rows(service, names, seed_list, Path(out))
    finally:
        service.pool.close()
    console.print(f"wrote {written} expert episodes ({tried} tried) to {path}", highlight=False, soft_wrap=True)
