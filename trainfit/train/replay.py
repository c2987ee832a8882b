"""`replay.html`: the episodes a multi-turn run kept (`transcripts.jsonl`, logging.save_transcripts),
one section per episode, failures first, filterable by reward; linked from report.html.

A computer-use turn shows the screenshot the policy acted on (kept by train/screens.py in the stage's
`screens/` folder, named by the hash the transcript records) with the click drawn where it landed,
the typed text or key, the model's raw reply, the action as the environment's parser reads it
(envs/cua_actions.py `parse_action`) or the parser's penalty message, and what the environment said
back. An episode without screenshots (tools, a simulated user, a text service) reads as a chat.

The page is plain HTML with a few lines of script for the reward filter; screenshots are linked
files beside it (relative paths), so the page stays small however many episodes a run keeps.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Optional

from PIL import Image

from trainfit.train.rundir import stage_dirs

REPLAY_FILE = "replay.html"
TRANSCRIPTS = "transcripts.jsonl"
SCREENS = "screens"       # <stage_dir>/screens/<sha256[:32]>.png (train/screens.py)
MAX_EPISODES = 300        # the latest ones; the page says how many it leaves out


def screen_file(folder: Path, sha256: str) -> Path:
    """Where a kept screenshot is written (train/screens.py) and read, by its transcript's hash."""
    return folder / f"{sha256[:32]}.png"


def _episodes(run_dir: Path) -> list[tuple[Path, str, dict]]:
    """(stage dir, stage name, record) for every transcript line of every stage."""
    out = []
    for d in stage_dirs(run_dir):
        path = d / TRANSCRIPTS
        if not path.is_file():
            continue
        with open(path) as f:
            for line in f:
                try:
                    out.append((d, d.name if d != run_dir else "", json.loads(line)))
                except json.JSONDecodeError:   # a line cut short by a killed run
                    continue
    return out


def _screen(stage_dir: Path, sha: str, page_dir: Path) -> tuple[Optional[str], Optional[tuple[int, int]]]:
    """(relative src, (width, height)) of a kept screenshot, or (None, None) when it was not kept."""
    path = screen_file(stage_dir / SCREENS, sha)
    if not path.is_file():
        return None, None
    with Image.open(path) as im:
        size = im.size
    meta = path.with_suffix(".json")   # the size the policy saw, when the kept copy was made smaller
    if meta.is_file():
        size = tuple(json.loads(meta.read_text())["size"])
    return os.path.relpath(path, page_dir), size


def _overlay(action, size: tuple[int, int]) -> str:
    """An SVG over the screenshot, in its pixel coordinates: a ring where a click or scroll landed."""
    w, h = size
    if getattr(action, "x", None) is None or getattr(action, "y", None) is None:
        return ""
    x, y = float(action.x), float(action.y)
    r = max(4.0, min(w, h) / 40)
    return (f'<svg class="overlay" viewBox="0 0 {w} {h}" preserveAspectRatio="none">'
            f'<circle class="click" cx="{x:g}" cy="{y:g}" r="{r:g}" fill="none" stroke="red" stroke-width="{r / 3:g}"/>'
            f'<circle cx="{x:g}" cy="{y:g}" r="{r / 4:g}" fill="red"/></svg>')


def _action_text(action) -> str:
    kind = getattr(action, "kind", "")
    if kind in ("type", "key"):
        return f"{kind}: {action.text}"
    return action.render() if hasattr(action, "render") else str(action)


def _content(m: dict) -> str:
    c = m.get("content", "")
    return c if isinstance(c, str) else json.dumps(c, ensure_ascii=False)


def _turns(stage_dir: Path, rec: dict, page_dir: Path) -> tuple[str, int]:
    """The episode's messages as HTML, and how many screenshots it showed."""
    # Here, not at the top: importing trainfit.envs loads torch and transformers, which a report of a run
    # without episodes (`trainfit report` on a 100k-step run) should not wait for.
    from trainfit.envs.cua_actions import parse_action

    parts, shot, shots = [], None, 0
    for m in rec.get("messages", []):
        role = m.get("role", "?")
        hashes = m.get("image_hashes") or []
        if hashes:
            shot = (hashes[-1], *_screen(stage_dir, hashes[-1], page_dir))
        text = html.escape(_content(m))
        if role != "assistant" or shot is None:
            parts.append(f'<div class="msg {html.escape(role)}"><b>{html.escape(role)}</b><pre>{text}</pre></div>')
            continue
        sha, src, size = shot
        if src is None:
            parts.append(f'<div class="turn"><p class="missing">screenshot {sha[:12]} was not kept</p>'
                         f'<div class="msg assistant"><b>reply</b><pre>{text}</pre></div></div>')
            continue
        shots += 1
        action = parse_action(_content(m), *size)
        parsed = (f'<p class="action">action: {html.escape(_action_text(action))}</p>' if hasattr(action, "kind")
                  else f'<p class="penalty">not an action: {html.escape(action.message)}</p>')
        parts.append(f'<div class="turn"><div class="shot" style="aspect-ratio:{size[0]}/{size[1]}">'
                     f'<img src="{html.escape(src)}" loading="lazy" width="{size[0]}" height="{size[1]}" '
                     f'alt="screenshot {sha[:12]}">{_overlay(action, size) if hasattr(action, "kind") else ""}</div>'
                     f'<div class="side"><div class="msg assistant"><b>reply</b><pre>{text}</pre></div>{parsed}</div>'
                     '</div>')
    return "".join(parts), shots


STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;color:#222}
section{border:1px solid #ddd;border-radius:6px;padding:8px 12px;margin:14px 0}
section.fail{border-left:6px solid #d62728}section.ok{border-left:6px solid #2ca02c}
.msg pre{white-space:pre-wrap;margin:2px 0 8px;background:#f6f6f6;padding:6px}.msg.assistant pre{background:#eef4ff}
.turn{display:flex;gap:14px;margin:10px 0}.shot{position:relative;width:min(480px,50%);flex:none}
.shot img{width:100%;height:auto;display:block;border:1px solid #ccc}
.overlay{position:absolute;left:0;top:0;width:100%;height:100%}.side{flex:1}
.penalty{color:#d62728}.action{color:#2c7a2c}.missing{color:#999}"""
# The reward filter: hide episodes whose reward is above the value typed (empty: show all).
FILTER = """function applyFilter() {
  var v = document.getElementById('max-reward').value, lim = v === '' ? Infinity : parseFloat(v);
  document.querySelectorAll('section.episode').forEach(function (s) {
    s.style.display = parseFloat(s.dataset.reward) <= lim ? '' : 'none';
  });
  document.querySelectorAll('tr.episode').forEach(function (r) {
    r.style.display = parseFloat(r.dataset.reward) <= lim ? '' : 'none';
  });
}
document.getElementById('max-reward').addEventListener('input', applyFilter);"""


def render(run_dir: Path, page_dir: Path) -> Optional[str]:
    eps = _episodes(run_dir)
    if not eps:
        return None
    total = len(eps)
    eps = sorted(eps, key=lambda e: e[2].get("step", 0))[-MAX_EPISODES:]     # the latest ones
    eps.sort(key=lambda e: (float(e[2].get("reward") or 0.0), -int(e[2].get("step", 0))))   # failures first
    index, sections = [], []
    for i, (d, stage, rec) in enumerate(eps):
        reward = float(rec.get("reward") or 0.0)
        body, shots = _turns(d, rec, page_dir)
        end = rec.get("error") or rec.get("end") or ""
        label = f"{stage} step {rec.get('step')}".strip()
        cls = "fail" if reward <= 0 or rec.get("failed") else "ok"
        index.append(f'<tr class="episode" data-reward="{reward:g}"><td><a href="#ep-{i}">{i}</a></td>'
                     f"<td>{html.escape(label)}</td><td>{reward:g}</td><td>{rec.get('turns', '')}</td>"
                     f"<td>{html.escape(str(end))}</td></tr>")
        sections.append(f'<section id="ep-{i}" class="episode {cls}" data-reward="{reward:g}" data-shots="{shots}">'
                        f"<h2>episode {i}: {html.escape(label)}, reward {reward:g}, {rec.get('turns', '?')} turns, "
                        f"ended: {html.escape(str(end))}</h2>{body}</section>")
    note = (f"<p>The latest {len(eps)} of {total} kept episodes.</p>" if total > len(eps)
            else f"<p>{total} kept episodes.</p>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>trainfit replay: {html.escape(str(run_dir))}"
            f"</title><style>{STYLE}</style></head><body><h1>episode replay: {html.escape(str(run_dir))}</h1>"
            f"<p><a href='report.html'>back to the report</a></p>{note}"
            "<p><label>show episodes with reward at most <input id='max-reward' type='number' step='any'></label> "
            "(empty: all; lowest rewards first)</p>"
            "<table><tr><th>#</th><th>episode</th><th>reward</th><th>turns</th><th>ended</th></tr>"
            f"{''.join(index)}</table>{''.join(sections)}<script>{FILTER}</script></body></html>")


def write_replay(run_dir: Path, out: Path) -> Optional[Path]:
    """Write the replay page for `run_dir` to `out`; None (and nothing written) when no episode was kept."""
    page = render(Path(run_dir), Path(out).parent)
    if page is None:
        return None
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out
