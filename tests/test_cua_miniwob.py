"""The MiniWoB++ environment service (envs/miniwob_service.py) with real headless Chromium browsers, through
trainfit's own HTTP client (envs/http.py): protocol, experts, concurrency, abandoned episodes, crashes,
and no Chromium left running after a crashed chromedriver or a closed pool.

Marked `cua` (deselected by `make test`; `make test-cua` installs the browser and runs them)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from trainfit.envs import EnvError, HTTPEnv
from trainfit.envs.cua_actions import parse_action

pytestmark = pytest.mark.cua

from cua_helpers import KEY, TASKS, client, expert, play_expert, row, served  # noqa: E402,F401
from trainfit.envs.miniwob_browser import Browser, BrowserPool  # noqa: E402
from trainfit.envs.miniwob_service import EVAL_SEED_OFFSET, MiniWoBService  # noqa: E402
from trainfit.envs.service_http import EnvServer  # noqa: E402


def test_reset_shows_the_screenshot_and_the_utterance(served, client):
    env = client()
    msgs = env.reset(row("click-button", 3))
    (m,) = msgs
    assert m["role"] == "user" and m["content"].count("<image>") == 1
    assert 'Task: Click on the "' in m["content"] and "click(x, y)" in m["content"]
    (im,) = m["_images"]
    assert im.size == (160, 210)
    env.close()


@pytest.mark.parametrize("task", TASKS)
def test_expert_trajectories_succeed(served, client, task):
    server, _, _ = served
    for seed in (0, 1):
        env = client()
        reward, actions, info = play_expert(server, env, row(task, seed))
        env.close()
        # MiniWoB's raw reward: +1 only when the task's own check passed.
        assert reward == 1.0 and info["success"] and info["miniwob_task"] == task, (task, seed, actions, info)


def test_malformed_and_off_screen_actions_are_penalised_and_change_nothing(served, client):
    server, _, _ = served
    env = client()
    env.reset(row("enter-text", 7))
    first = expert(server, env)
    for bad, says in [("I would click the box", "no action found"), ("click(500, 20)", "outside the screen"),
                      ('key("Hyper")', "unknown key")]:
        res = env.step(bad)
        assert res.reward == -0.1 and not res.done and says in res.info["invalid_action"]
        (m,) = res.observation
        assert m["content"].startswith("Invalid action: ") and says in m["content"]
    assert expert(server, env) == first          # the screen did not change
    rewards = [env.step(first).reward]
    for _ in range(2):
        rewards.append(env.step(expert(server, env)).reward)
    assert rewards == [0.0, 0.0, 1.0]
    env.close()


def test_steps_are_idempotent_and_ordered(served, client):
    server, _, _ = served
    env = client()
    env.reset(row("enter-text", 11))
    h = {"Authorization": f"Bearer {KEY}"}
    post = lambda body: httpx.post(f"{server.url}/step", json=body, headers=h, timeout=60)  # noqa: E731
    click = expert(server, env)
    r1 = post({"episode_id": env.episode_id, "step": 1, "action": click})
    typed = None
    r2 = post({"episode_id": env.episode_id, "step": 2, "action": (typed := expert(server, env))})
    again = post({"episode_id": env.episode_id, "step": 2, "action": typed})   # a retried request
    assert r1.status_code == r2.status_code == again.status_code == 200 and again.json() == r2.json()
    # Typed once, not twice: the expert's next move is Submit (it would select and retype otherwise).
    nxt = parse_action(expert(server, env), 160, 210)
    assert nxt.kind == "click"
    skipped = post({"episode_id": env.episode_id, "step": 5, "action": "done()"})
    assert skipped.status_code == 409 and "the next step is 3" in skipped.json()["error"]
    done = post({"episode_id": env.episode_id, "step": 3, "action": "done()"}).json()
    assert done["done"] and done["reward"] == 0.0     # MiniWoB had not ended it: its reward is 0
    env.close()


def test_key_is_required(served):
    server, _, _ = served
    r = httpx.post(f"{server.url}/reset", json={"task": {"miniwob_task": "click-button"}}, timeout=30)
    assert r.status_code == 401
    with pytest.raises(EnvError, match="HTTP 401.*check the key"):
        HTTPEnv(server.url, api_key_env="NO_SUCH_VARIABLE_SET", retries=0).reset(row("click-button", 1))
    bad = httpx.post(f"{server.url}/step", content=b"{not json", timeout=30,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]


def test_eval_seeds_are_disjoint_from_training_seeds(served, client):
    server, service, _ = served
    env = client()
    env.reset(row("click-button", 5, split="eval"))
    ep = service.episodes[env.episode_id]
    assert ep.seed == EVAL_SEED_OFFSET + 5 and ep.mode == "test"
    env.close()
    with pytest.raises(EnvError, match=r"HTTP 400.*`seed` must be an integer in \[0, 1000000\)"):
        client().reset(row("click-button", EVAL_SEED_OFFSET + 5))
    with pytest.raises(EnvError, match="serves click-button"):
        client().reset(row("book-flight", 1))


def test_concurrent_episodes_share_the_pool_with_nothing_lost(served, client):
    """32 enter-text episodes in lock-step (as the trainer steps them) on 4 browsers: episodes whose
    browser was taken are replayed from their seed and actions; every one succeeds."""
    server, service, pool = served
    envs = [client() for _ in range(32)]
    replays = pool.stats()["replays"]
    with ThreadPoolExecutor(32) as ex:
        list(ex.map(lambda ie: ie[1].reset(row("enter-text", 100 + ie[0])), enumerate(envs)))
        rewards = [0.0] * 32
        for _ in range(3):
            actions = list(ex.map(lambda e: expert(server, e), envs))
            stuck = [(service.episodes[e.episode_id].elements, service.episodes[e.episode_id].actions)
                     for e, a in zip(envs, actions) if a is None]
            assert not stuck, stuck
            results = list(ex.map(lambda ea: ea[0].step(ea[1]), zip(envs, actions)))
            rewards = [r + res.reward for r, res in zip(rewards, results)]
        assert all(res.done for res in results)
        list(ex.map(lambda e: e.close(), envs))
    assert rewards == [1.0] * 32
    assert pool.stats()["replays"] > replays and pool.stats()["running"] <= 4


def test_abandoned_episodes_are_closed(served, client):
    _, _, pool = served
    service = MiniWoBService(["click-button"], pool, episode_timeout_s=0.3)
    server = EnvServer(service, sweep_s=0.1).start()
    try:
        env = HTTPEnv(server.url, timeout_s=60.0, retries=0)
        env.reset(row("click-button", 2))
        deadline = time.monotonic() + 10
        while service.episodes and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not service.episodes and service.closed_idle == 1
        assert all(s.owner != env.episode_id for s in pool.slots)   # its browser went back to the pool
        with pytest.raises(EnvError, match="HTTP 404.*idle longer than 0.3s"):
            env.step("done()")
    finally:
        server.stop()


def test_a_crashed_browser_is_replaced_and_its_episode_failed(served, client):
    server, service, pool = served
    env = client()
    env.reset(row("click-button", 9))
    (slot,) = [s for s in pool.slots if s.owner == env.episode_id]
    replaced = pool.stats()["replaced"]
    slot.browser.env.instance.driver.quit()          # the browser dies between two steps
    with pytest.raises(EnvError) as e:
        env.step(expert(server, env))
    msg = str(e.value)
    assert "HTTP 410" in msg and "browser failed during this step and was replaced; episode over" in msg
    assert "the other episodes go on" in msg
    assert pool.stats()["replaced"] == replaced + 1
    # The pool goes on: the next episode gets a fresh browser and succeeds.
    reward, _, _ = play_expert(server, client(), row("click-button", 9))
    assert reward == 1.0


def chromium_of(browser) -> list:
    """The browser's Chromium processes (chromedriver's descendants), counted independently of how
    the service ends them."""
    driver = psutil.Process(browser.driver_process.pid)
    return [p for p in driver.children(recursive=True) if "chrom" in p.name()]


def running(procs: list) -> list:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_killed_chromedriver_leaves_no_chromium_behind():
    service = MiniWoBService(["click-button"], BrowserPool(1))
    try:
        eid = service.reset({"seed": 4})["episode_id"]
        browser = service.pool.slots[0].browser
        procs = chromium_of(browser)
        assert len(running(procs)) >= 3                      # the browser, its zygotes, a renderer...
        browser.driver_process.kill()                         # chromedriver dies mid-episode
        code, body = service.step({"episode_id": eid, "step": 1, "action": "click(80, 100)"})
        assert code == 410 and "episode over" in body["error"]
        assert running(procs) == []                           # its orphaned Chromium was ended with it
        assert browser.profile is None or not os.path.exists(browser.profile)
    finally:
        service.pool.close()


def test_closing_the_pool_leaves_no_chromium_behind():
    pool = BrowserPool(2)
    service = MiniWoBService(["click-button", "click-test"], pool)
    service.reset({"seed": 0})
    service.reset({"seed": 1})
    procs = [p for s in pool.slots for p in chromium_of(s.browser)]
    assert len(running(procs)) >= 6
    pool.close()                                              # what the service does when it stops
    assert running(procs) == []


def screenshots(browser, task: str, seed: int, pause_s: float = 0.0) -> list[bytes]:
    """The screenshots of the expert's episode on `task` at `seed`, as PNG bytes (what the service sends)."""
    from trainfit.envs.miniwob_expert import advise, dom_view
    from trainfit.envs.miniwob_service import png_part

    obs = browser.reset(seed)
    shots, history = [png_part(obs["screenshot"])["image"]], []
    for _ in range(6):
        act = advise(obs["utterance"], dom_view(obs), history).action
        history.append(act)
        time.sleep(pause_s)          # another phase of the caret's blink, another moment of any animation
        obs, _, done, _ = browser.step(act)
        if done:
            return shots
        shots.append(png_part(obs["screenshot"])["image"])
    raise AssertionError(f"{task} seed {seed}: the expert did not finish")


@pytest.mark.parametrize("task", ["enter-text", "click-tab", "click-dialog"])
def test_the_same_seed_and_actions_give_byte_identical_screenshots(task):
    first, second = Browser(task), Browser(task)
    try:
        want = screenshots(first, task, 0)
        for seed in (1, 2, 0):       # another history on the second browser: its pointer, focus and page differ
            got = screenshots(second, task, seed, pause_s=0.3)
        assert len(want) >= (3 if task == "enter-text" else 1) and got == want
        assert screenshots(first, task, 0) == want       # and the first browser again, after its own episode
    finally:
        first.close()
        second.close()


def test_a_focused_input_looks_the_same_whenever_it_is_captured():
    from trainfit.envs.miniwob_expert import advise, dom_view

    browser = Browser("enter-text")
    try:
        obs = browser.reset(3)
        browser.step(advise(obs["utterance"], dom_view(obs)).action)   # focus the input
        seen = set()
        for _ in range(6):           # 1.5 s: three blinks of a caret, were one drawn
            shot, _ = browser.env.instance.get_observation(use_cached_fields=True)
            seen.add(shot["screenshot"].tobytes())
            time.sleep(0.25)
        assert len(seen) == 1
    finally:
        browser.close()
