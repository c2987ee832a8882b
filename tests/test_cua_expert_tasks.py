"""The MiniWoB++ DOM expert on real pages (make test-cua): it wins seeds of every task it claims to solve,
driven through the service as the SFT row writer and bench/cua_expert_eval.py drive it, and over HTTP a
task it cannot act on answers /expert with no action and the reason."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.cua

from cua_helpers import KEY  # noqa: E402  (skips this module without Chromium or miniwob)
from trainfit.envs.miniwob_browser import BrowserPool  # noqa: E402
from trainfit.envs.miniwob_expert import SOLVED  # noqa: E402
from trainfit.envs.miniwob_service import MiniWoBService  # noqa: E402
from trainfit.envs.service_http import EnvServer  # noqa: E402

DECLINED = ["click-scroll-list", "identify-shape"]


@pytest.fixture(scope="module")
def service():
    svc = MiniWoBService(list(SOLVED) + DECLINED, BrowserPool(1), episode_timeout_s=600)
    yield svc
    svc.pool.close()


def play(service, task, seed, split="eval", max_steps=12):
    eid = service.reset({"miniwob_task": task, "seed": seed, "split": split})["episode_id"]
    actions = []
    try:
        for step in range(1, max_steps + 1):
            advice = service.expert({"episode_id": eid})
            assert advice["action"] is not None, (task, seed, actions, advice)
            actions.append(advice["action"])
            code, reply = service.step({"episode_id": eid, "step": step, "action": advice["action"]})
            assert code == 200, reply
            if reply["done"]:
                return reply["reward"], actions
    finally:
        service.close({"episode_id": eid})
    raise AssertionError(f"{task} seed {seed}: not done after {actions}")


@pytest.mark.parametrize("task", SOLVED)
def test_the_expert_wins_each_task_it_claims(service, task):
    # An evaluation instance (20: click-test-2's two buttons overlap there) and a training instance.
    for seed, split in ((20, "eval"), (500, "train")):
        reward, actions = play(service, task, seed, split)
        assert reward == 1.0, (task, seed, split, actions)


def test_a_task_it_cannot_act_on_answers_why_over_http(service):
    server = EnvServer(service, key=KEY).start()
    h = {"Authorization": f"Bearer {KEY}"}
    try:
        for task, says in [("click-scroll-list", "ctrl+click"), ("identify-shape", "no instruction the expert reads")]:
            r = httpx.post(f"{server.url}/reset", json={"task": task}, headers=h, timeout=60)
            eid = r.json()["episode_id"]
            got = httpx.post(f"{server.url}/expert", json={"episode_id": eid}, headers=h, timeout=60).json()
            assert got["action"] is None and says in got["why"], got
            httpx.post(f"{server.url}/close", json={"episode_id": eid}, headers=h, timeout=60)
    finally:
        server.stop()
