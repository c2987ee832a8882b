"""The README's picture of `trainfit plan --html`, taken in headless Chromium.

    .venv/bin/python -m bench.plan_screenshot [CONFIG] [--gpu NAME] [--out docs]

Plans CONFIG (default examples/cua_grpo_single_gpu.yaml on an H200) into its HTML page and writes the page's
screenshot, down to the first stage's figure (header, device and CPU RAM bars, legend), as OUT/plan.png; exits
non-zero on a console error in the page.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from typer.testing import CliRunner

from bench.browser import Page
from trainfit.app.cli import app

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default=str(ROOT / "examples" / "cua_grpo_single_gpu.yaml"))
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--out", default=str(ROOT / "docs"))
    ap.add_argument("--height", type=int, default=0, help="CSS pixels; default: down to the first figure's bottom")
    args = ap.parse_args()
    config, out = Path(args.config).resolve(), Path(args.out).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        # run from a scratch folder that sees the examples (their data paths are relative), so a local model
        # path in the notes is this folder's, not the checkout's
        (Path(tmp) / "examples").symlink_to(ROOT / "examples")
        os.chdir(tmp)
        if config.is_relative_to(ROOT / "examples"):
            config = config.relative_to(ROOT)
        page_path = Path(tmp) / "plan.html"
        r = CliRunner().invoke(app, ["plan", str(config), "--gpu", args.gpu, "--html", str(page_path)])
        if not page_path.is_file():
            raise SystemExit(f"plan failed (exit {r.exit_code}):\n{r.output}")
        with Page(page_path) as page:
            page.settle(1.0)
            height = args.height or int(page.eval("document.querySelector('.chart').getBoundingClientRect().bottom")) + 16
            print(page.screenshot(out / "plan.png", height=height))
            if page.errors:
                raise SystemExit(f"console errors: {page.errors}")


if __name__ == "__main__":
    main()
