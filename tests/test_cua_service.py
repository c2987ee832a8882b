"""The MiniWoB++ service's bookkeeping with a stand-in browser (no Chromium): a busy pool answers 503
without spending the step, episodes that lose their browser are replayed, a crash is answered 410 every
time the step is retried. The real browsers are in test_cua_miniwob.py and test_cua_training.py (make test-cua)."""

from __future__ import annotations

import numpy as np

from trainfit.envs.miniwob_browser import BrowserPool
from trainfit.envs.miniwob_service import MiniWoBService


class FakeBrowser:
    """A task that ends with reward 1 on the second click; `explode` makes the next step raise."""

    made = 0

    def __init__(self, task):
        FakeBrowser.made += 1
        self.task, self.log, self.clicks, self.explode = task, [], 0, False

    def reset(self, seed, mode="train"):
        self.log.append(("reset", seed))
        self.clicks = 0
        return {"utterance": f"Click twice ({seed}).", "fields": (("target", "x"),), "dom_elements": [],
                "screenshot": np.zeros((210, 160, 3), dtype=np.uint8)}

    def step(self, action):
        if self.explode:
            raise RuntimeError("chrome not reachable")
        self.log.append(("step", action.render()))
        self.clicks += action.kind == "click"
        done = self.clicks >= 2
        obs = {"utterance": "", "fields": (), "dom_elements": [], "screenshot": np.zeros((210, 160, 3), np.uint8)}
        return obs, 1.0 if done else 0.0, done, {"reason": None}

    def allowed_keys(self):
        return ("<Enter>",)

    def retarget(self, task):
        self.task = task

    def close(self):
        pass


def service(size=1, **kw):
    return MiniWoBService(["click-button"], BrowserPool(size, make=FakeBrowser), **kw)


def step(svc, eid, k, action):
    return svc.step({"episode_id": eid, "step": k, "action": action})


def test_a_busy_pool_answers_503_without_spending_the_step():
    svc = service(wait_s=0.05)
    eid = svc.reset({"seed": 1})["episode_id"]
    holding = svc.pool.hold("someone-else", "click-button")
    holding.__enter__()                                   # the only browser is in use
    code, body = step(svc, eid, 1, "click(5, 5)")
    assert code == 503 and "all browsers are busy" in body["error"]
    holding.__exit__(None, None, None)
    code, body = step(svc, eid, 1, "click(5, 5)")       # the client's retry of the same step
    assert code == 200 and not body["done"]


def test_episodes_that_lose_their_browser_are_replayed():
    svc = service(size=1)
    a = svc.reset({"seed": 1})["episode_id"]
    b = svc.reset({"seed": 2})["episode_id"]             # took the only browser from a
    assert step(svc, b, 1, "click(1, 1)")[0] == 200
    code, body = step(svc, a, 1, "click(2, 2)")          # a comes back: reset seed 1, then its click
    assert code == 200 and not body["done"]
    code, body = step(svc, b, 2, "click(3, 3)")          # b again: seed 2 and its first click replayed
    assert body["done"] and body["reward"] == 1.0
    (browser,) = [s.browser for s in svc.pool.slots]
    assert browser.log[-3:] == [("reset", 2), ("step", "click(1, 1)"), ("step", "click(3, 3)")]
    assert svc.pool.stats()["replays"] == 2 and FakeBrowser.made >= 1


def test_a_crash_is_answered_410_on_every_retry_and_the_browser_replaced():
    svc = service(size=1)
    eid = svc.reset({"seed": 4})["episode_id"]
    svc.pool.slots[0].browser.explode = True
    made = FakeBrowser.made
    first = step(svc, eid, 1, "click(1, 1)")
    assert first[0] == 410 and "RuntimeError: chrome not reachable" in first[1]["error"]
    assert step(svc, eid, 1, "click(1, 1)") == first                 # idempotent: the same answer
    assert svc.pool.stats()["replaced"] == 1 and svc.pool.slots[0].browser is None
    other = svc.reset({"seed": 5})["episode_id"]                     # a fresh browser for the next episode
    assert FakeBrowser.made == made + 1 and step(svc, other, 1, "click(1, 1)")[0] == 200


def test_done_and_penalties_need_no_browser():
    svc = service(size=1, penalty=-0.25)
    eid = svc.reset({"seed": 6})["episode_id"]
    code, body = step(svc, eid, 1, "click(999, 1)")
    assert code == 200 and body["reward"] == -0.25 and "outside the screen" in body["observation"][0]["content"]
    code, body = step(svc, eid, 2, 'key("Tab")')                     # a key this screen does not accept
    assert body["reward"] == -0.25 and "not one this screen accepts" in body["info"]["invalid_action"]
    code, body = step(svc, eid, 3, "done()")
    assert body == {"observation": [], "reward": 0.0, "done": True, "info": {"end": "agent_done", "success": False}}
    assert svc.pool.slots[0].owner is None                           # the browser is free for anyone
