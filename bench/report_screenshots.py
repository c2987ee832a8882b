"""The README's pictures of the run report and the episode replay, taken in headless Chromium.

    .venv/bin/python -m bench.report_screenshots RUN_DIR [--replay RUN_DIR] [--out docs]

Writes `trainfit report RUN_DIR`'s page as OUT/report.png, and the replay page of the `--replay` run
(one that kept episodes, e.g. a computer-use run) as OUT/replay.png. The README's pictures came from
a shortened demo (600 SFT steps, 30 GRPO steps: the command is in the README) and from multi-turn GRPO of
the tiny VLM against a screen service (tests/report_helpers.py `screen_run`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.browser import Page
from trainfit.train.report_html import write_report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--replay", help="a run dir with kept episodes (transcripts.jsonl)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs"))
    ap.add_argument("--height", type=int, default=2400)
    args = ap.parse_args()
    out = Path(args.out)
    with Page(write_report(Path(args.run_dir))) as page:
        print(page.screenshot(out / "report.png", height=args.height))
        if page.errors:
            raise SystemExit(f"console errors: {page.errors}")
    if args.replay:
        write_report(Path(args.replay))
        with Page(Path(args.replay) / "replay.html") as page:
            page.eval("document.querySelectorAll('img').forEach(function (i) { i.loading = 'eager'; })")
            # From the first episode that earned a reward, where the clicks are (failures come first).
            print(page.screenshot(out / "replay.png", height=1300, selector="section.episode.ok"))
            if page.errors:
                raise SystemExit(f"console errors: {page.errors}")


if __name__ == "__main__":
    main()
