"""A screenshot environment for measuring a computer-use GRPO step: trainfit's HTTP environment
protocol (trainfit/envs/service_http.py) answered with full-size PNG screenshots and no browser.

    server = serve_screens(1920, 1080)     # EnvServer on 127.0.0.1, a free port; server.url, server.stop()
    server = serve_screens(160, 210, delay_s=0.25)   # each /reset and /step answered 0.25 s late

/reset answers the task's text and a first screenshot; every /step another screenshot (a different
colour each turn, so no two are alike), never done, reward 1 for an action of odd length. What the
planner and the trainer care about is the shape of an episode: how many screenshots of what size, and
how many turns, which the config sets (model.max_pixels, rollout.max_turns, max_images_per_episode).
"""

from __future__ import annotations

import base64
import io
import itertools
import threading
import time

from trainfit.envs.service_http import EnvServer, Refused


def png(width: int, height: int, shade: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (40 * shade % 256, 90, 200)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


class Screens:
    def __init__(self, width: int, height: int, delay_s: float = 0.0):
        self.width, self.height, self.delay_s = width, height, delay_s   # delay_s: each reset / step's latency
        self.ids = itertools.count()
        self.turns: dict[str, int] = {}
        self.lock = threading.Lock()

    def shot(self, k: int) -> dict:
        return {"type": "image", "image": png(self.width, self.height, k)}

    def reset(self, row: dict) -> dict:
        time.sleep(self.delay_s)
        with self.lock:
            eid = f"e{next(self.ids)}"
            self.turns[eid] = 0
        task = (row.get("messages") or [{}])[0].get("content") or "Do the task."
        return {"episode_id": eid, "observation": [{"role": "user", "content": [
            {"type": "text", "text": f"{task} One action per turn: click(x, y)."}, self.shot(0)]}]}

    def step(self, body: dict) -> tuple[int, dict]:
        eid = body.get("episode_id")
        time.sleep(self.delay_s)
        with self.lock:
            if eid not in self.turns:
                raise Refused(404, f"no episode {eid!r}")
            self.turns[eid] += 1
            k = self.turns[eid]
        return 200, {"observation": [{"role": "user", "content": [self.shot(k)]}],
                     "reward": float(len(str(body.get("action", ""))) % 2), "done": False}

    def close(self, body: dict) -> dict:
        with self.lock:
            self.turns.pop(body.get("episode_id"), None)
        return {"closed": True}

    def expert(self, body: dict) -> dict:
        return {"action": None}

    def health(self) -> dict:
        return {"ok": True, "episodes": len(self.turns)}

    def close_idle(self) -> None:
        pass

    def authorised(self, header, key) -> bool:
        return key is None or header == f"Bearer {key}"


def serve_screens(width: int, height: int, delay_s: float = 0.0) -> EnvServer:
    return EnvServer(Screens(width, height, delay_s)).start()
