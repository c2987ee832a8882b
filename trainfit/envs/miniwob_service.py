"""MiniWoB++ as an environment service speaking trainfit's HTTP environment protocol (envs/http.py).

    trainfit env serve miniwob --tasks click-button,enter-text --port 8080 [--key-env MY_KEY] [--pool 4]
    # a run:  env.type: http, env.url: http://127.0.0.1:8080

/reset {"task": {...row}} opens one MiniWoB++ episode ({"task": "click-button"} names just the task; a
name or a `miniwob_task` the service does not serve is answered 400 listing those it does). The row may
name `miniwob_task` (one of the served tasks; default: tasks[seed % n]), `seed` (an int; default a fresh
training seed) and `split` ("train", default, or "eval"). Held-out evaluation: split "eval" plays MiniWoB seed
EVAL_SEED_OFFSET + seed in MiniWoB's "test" data mode; a training seed must be below EVAL_SEED_OFFSET, so
no training episode ever shows an evaluation instance.
Its observation is one user message: the instructions and the task's utterance as text, then the
screenshot (160x210 RGB PNG) as an image part. Each /step's observation is the new screenshot.

Actions: one per turn, as trainfit/envs/cua_actions.py documents: click(x, y), double_click(x, y),
type("text"), key("Enter"), scroll(x, y, "down"), done(), or Qwen2.5-VL's computer_use <tool_call>;
coordinates are pixels of the screenshot. A malformed or off-screen action changes nothing: the reply is
a text observation saying what was wrong, with reward `penalty` (default -0.1), and the episode goes on.
Every reply's info says `success` (MiniWoB ended the task with a positive reward), so an evaluation counts
an episode of invalid actions as a failure (train/evaluate.py episode_eval).
done() ends the episode with MiniWoB's reward so far (0: MiniWoB had not ended it).
The episode's MiniWoB reward is its raw reward (+1 success, -1 failure, partial credit on some tasks),
given on the step where MiniWoB ends the episode; the 10 s task timer is lifted (see miniwob_browser.py).

Steps are idempotent in (episode_id, step): a repeated step gets the first reply. Episodes share a
bounded pool of browsers (miniwob_browser.py); one idle longer than `episode_timeout_s` is closed. A
browser that crashes is replaced, and the episode it served is answered with HTTP 410 and the reason,
which the trainer reports as that episode's failure (the other episodes go on).
POST /expert {"episode_id"} -> {"action": "<the expert's next action>"}, or {"action": null, "why": "..."}
where miniwob_expert.py's expert cannot read the utterance or find what it needs on the screen.
GET /health -> tasks, pool and episode counts (no key needed).
"""

from __future__ import annotations

import base64
import hmac
import io
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from .cua_actions import ACTIONS, USAGE, ParseError, parse_action
from .miniwob_browser import BrowserPool
from .miniwob_expert import advise, dom_view
from .service_http import Refused

EVAL_SEED_OFFSET = 1_000_000
log = logging.getLogger(__name__)


@dataclass
class EpisodeState:
    id: str
    task: str
    seed: int                  # MiniWoB's seed (eval seeds already offset)
    mode: str                  # MiniWoB data mode: train | test
    actions: list = field(default_factory=list)      # actions MiniWoB applied, for replay on another browser
    replies: dict = field(default_factory=dict)      # step -> (code, body): idempotent steps
    utterance: str = ""
    elements: list = field(default_factory=list)     # the current screen's DOM (dom_view)
    done: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:80] if str(e).strip() else ""


def png_part(screenshot) -> dict:
    """A MiniWoB screenshot (H x W x 3 uint8) as the protocol's image part."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(screenshot).save(buf, format="PNG")
    return {"type": "image", "image": base64.b64encode(buf.getvalue()).decode()}


class MiniWoBService:
    """The protocol's logic, independent of the HTTP server (tests may call it directly)."""

    def __init__(self, tasks: list[str], pool: BrowserPool, *, penalty: float = -0.1,
                 episode_timeout_s: float = 300.0, width: int = 160, height: int = 210, wait_s: float = 120.0):
        self.tasks, self.pool, self.penalty, self.wait_s = list(tasks), pool, penalty, wait_s
        self.episode_timeout_s, self.width, self.height = episode_timeout_s, width, height
        self.episodes: dict[str, EpisodeState] = {}
        self.lock = threading.Lock()
        self.seeds = itertools.count()
        self.closed_idle = 0

    def _choose(self, row: dict) -> tuple[str, int, str]:
        split = row.get("split") or "train"
        if split not in ("train", "eval"):
            raise Refused(400, f"task field `split` must be \"train\" or \"eval\", got {split!r:.40}.")
        seed = row.get("seed")
        if seed is None:
            seed = next(self.seeds)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < EVAL_SEED_OFFSET:
            raise Refused(400, f"task field `seed` must be an integer in [0, {EVAL_SEED_OFFSET}), got {seed!r:.40} "
                               "(evaluation instances are split \"eval\" with their own seeds from 0).")
        task = row.get("miniwob_task")
        task = self.tasks[seed % len(self.tasks)] if task is None else task
        if not isinstance(task, str) or task not in self.tasks:
            raise Refused(400, f"task field `miniwob_task` is {task!r:.60}; this service serves "
                               f"{', '.join(self.tasks)} (start it with --tasks to serve others).")
        if split == "eval":
            return task, EVAL_SEED_OFFSET + seed, "test"
        return task, seed, "train"

    def _look(self, ep: EpisodeState, obs: dict) -> None:
        ep.utterance = str(obs.get("utterance") or "")
        ep.elements = dom_view(obs)

    def reset(self, row) -> dict:
        if isinstance(row, str):      # {"task": "click-button"}: the task by name
            row = {"miniwob_task": row}
        elif row is None:
            row = {}
        elif not isinstance(row, dict):
            raise Refused(400, f"`task` must be a task row (an object) or a task name, got {type(row).__name__}; "
                               f"this service serves {', '.join(self.tasks)}.")
        task, seed, mode = self._choose(row)
        ep = EpisodeState(uuid.uuid4().hex, task, seed, mode)
        try:
            with self.pool.hold(ep.id, task, self.wait_s) as (browser, _):
                obs = browser.reset(seed, mode)
        except TimeoutError as e:
            raise Refused(503, f"all browsers are busy: {e}; retry later or start the service with a larger --pool.")
        except Exception as e:
            log.warning("browser replaced: it failed to start %s seed %s (%s: %s)", task, seed, type(e).__name__,
                        _first_line(e))
            raise Refused(503, f"the browser failed to start task {task} ({type(e).__name__}: {str(e)[:200]}); "
                               "it was replaced, retry.") from None
        self._look(ep, obs)
        with self.lock:
            self.episodes[ep.id] = ep
        text = (f"You control a web page through its {self.width}x{self.height} screenshot (pixel (0, 0) is the "
                f"top-left corner). Task: {obs['utterance']}\nOne action per turn: {ACTIONS}.")
        return {"episode_id": ep.id, "observation": [{"role": "user", "content": [
            {"type": "text", "text": text}, png_part(obs["screenshot"])]}]}

    def _episode(self, body: dict) -> EpisodeState:
        eid = body.get("episode_id") if isinstance(body, dict) else None
        with self.lock:
            ep = self.episodes.get(str(eid))
        if ep is None:
            raise Refused(404, f"no episode {eid!r:.60} (never opened, closed, or idle longer than "
                               f"{self.episode_timeout_s:g}s).")
        ep.last_seen = time.monotonic()
        return ep

    def step(self, body: dict) -> tuple[int, dict]:
        ep = self._episode(body)
        step, action = body.get("step"), body.get("action")
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(action, str):
            raise Refused(400, "a step is {\"episode_id\": str, \"step\": int, \"action\": str}.")
        with ep.lock:
            if step in ep.replies:
                return ep.replies[step]
            if step != len(ep.replies) + 1:
                raise Refused(409, f"step {step} of episode {ep.id}: the next step is {len(ep.replies) + 1}.")
            if ep.done:
                raise Refused(409, f"episode {ep.id} is over.")
            reply = self._act(ep, action)
            if reply[0] == 503:   # no browser free yet: nothing happened, the client's retry may succeed
                return reply
            ep.replies[step] = reply
            if reply[0] != 200 or reply[1]["done"]:
                ep.done = True
                self.pool.disown(ep.id)
            return reply

    def _act(self, ep: EpisodeState, text: str) -> tuple[int, dict]:
        try:
            act = parse_action(text, self.width, self.height)
        except Exception as e:  # noqa: BLE001 - the parser is fuzzed never to raise; if it did, still a penalty
            act = ParseError(f"the action could not be read ({type(e).__name__}); {USAGE}.")
        if isinstance(act, ParseError):
            return 200, self._penalty(act.message)
        if act.kind == "done":
            return 200, {"observation": [], "reward": 0.0, "done": True,
                         "info": {"end": "agent_done", "success": False}}
        try:
            with self.pool.hold(ep.id, ep.task, self.wait_s) as (browser, intact):
                if not intact:   # first the episode's own screen: the key is judged there, and the browser is now its
                    self._replay(browser, ep)
                if act.kind == "key" and act.text not in browser.allowed_keys():
                    return 200, self._penalty(f"key {act.render()[4:-1]} is not one this screen accepts.")
                obs, reward, done, info = browser.step(act)
        except TimeoutError as e:
            return 503, {"error": f"all browsers are busy: {e}"}
        except Exception as e:
            # Short, reason first: clients quote the first 200 characters of an error body.
            first = _first_line(e)
            log.warning("browser replaced: it failed during step %d of episode %s (%s seed %s; %s: %s); the "
                        "episode is answered 410", len(ep.replies) + 1, ep.id, ep.task, ep.seed, type(e).__name__,
                        first)
            return 410, {"error": f"browser failed during this step and was replaced; episode over ({ep.task} seed "
                                  f"{ep.seed}; {type(e).__name__}: {first})"}
        ep.actions.append(act)
        info_out = {"miniwob_task": ep.task, "success": done and reward > 0}
        if done:
            reason = info.get("reason")   # MiniWoB's reason for ending (None when it gives none): null, not "None"
            info_out["reason"] = None if reason is None else str(reason)[:200]
            return 200, {"observation": [], "reward": reward, "done": True, "info": info_out}
        self._look(ep, obs)
        return 200, {"observation": [{"role": "user", "content": [png_part(obs["screenshot"])]}],
                     "reward": 0.0, "done": False, "info": info_out}

    def _replay(self, browser, ep: EpisodeState) -> None:
        """Rebuild the episode on a browser that served others since: same seed, same actions."""
        browser.reset(ep.seed, ep.mode)
        with self.pool.cond:
            self.pool.replays += 1
        for a in ep.actions:
            _, _, done, _ = browser.step(a)
            if done:
                raise RuntimeError("replaying the episode's actions ended it early (the task is not "
                                   "deterministic in its seed); serve it with --pool >= concurrent episodes")

    def _penalty(self, message: str) -> dict:
        return {"observation": [{"role": "user", "content": f"Invalid action: {message} The screen did not change."}],
                "reward": self.penalty, "done": False, "info": {"invalid_action": message, "success": False}}

    def expert(self, body: dict) -> dict:
        ep = self._episode(body)
        with ep.lock:
            if ep.done:
                return {"action": None, "why": "the episode is over"}
            advice = advise(ep.utterance, ep.elements, ep.actions)
        if advice.action is None:
            return {"action": None, "why": advice.why}
        return {"action": advice.action.render()}

    def close(self, body: dict) -> dict:
        eid = str(body.get("episode_id")) if isinstance(body, dict) else ""
        with self.lock:
            ep = self.episodes.pop(eid, None)
        if ep is not None:
            self.pool.disown(eid)
        return {"closed": ep is not None}

    def close_idle(self) -> int:
        """Close episodes nobody stepped for episode_timeout_s; how many."""
        now = time.monotonic()
        with self.lock:
            idle = [k for k, ep in self.episodes.items() if now - ep.last_seen > self.episode_timeout_s]
            for k in idle:
                del self.episodes[k]
            self.closed_idle += len(idle)
        for k in idle:
            self.pool.disown(k)
        return len(idle)

    def health(self) -> dict:
        with self.lock:
            n = len(self.episodes)
        return {"tasks": self.tasks, "episodes": n, "closed_idle": self.closed_idle, "pool": self.pool.stats()}

    def authorised(self, header: Optional[str], key: Optional[str]) -> bool:
        return key is None or hmac.compare_digest((header or "").encode(), f"Bearer {key}".encode())
