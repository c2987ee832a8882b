"""Shared by the MiniWoB++ tests (make test-cua): a service with real browsers on 127.0.0.1, task rows,
and the expert driven over HTTP. Importing this module skips the importing test module when Chromium,
chromedriver or the miniwob package is missing."""

from __future__ import annotations

import httpx
import pytest

from trainfit.envs import HTTPEnv
from trainfit.tasks import Example

try:
    from trainfit.envs.miniwob_browser import BrowserPool, import_miniwob, locate_browser

    locate_browser()
    import_miniwob()
except Exception as e:  # noqa: BLE001 - any missing piece skips the module with its message
    pytest.skip(f"MiniWoB++ is not runnable here ({e}); `make test-cua` installs it", allow_module_level=True)

from trainfit.envs.miniwob_service import MiniWoBService  # noqa: E402
from trainfit.envs.service_http import EnvServer  # noqa: E402

TASKS = ["click-button", "enter-text", "click-link", "focus-text", "click-test-2", "click-tab", "click-dialog",
         "focus-text-2"]
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def served():
    pool = BrowserPool(4)
    service = MiniWoBService(TASKS, pool, penalty=-0.1, episode_timeout_s=600)
    server = EnvServer(service, key=KEY).start()
    yield server, service, pool
    server.stop()
    pool.close()


@pytest.fixture
def client(served, monkeypatch):
    monkeypatch.setenv("CUA_TEST_KEY", KEY)
    return lambda **kw: HTTPEnv(served[0].url, api_key_env="CUA_TEST_KEY", timeout_s=60.0, retries=0, **kw)


def row(task, seed, split="train"):
    return Example("", None, "", "", {"miniwob_task": task, "seed": seed, "split": split})


def expert(server, env) -> str | None:
    r = httpx.post(f"{server.url}/expert", json={"episode_id": env.episode_id},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    r.raise_for_status()
    return r.json()["action"]


def play_expert(server, env, ex, max_steps=6):
    """Reset, then the expert's actions until done: (reward, actions, info of the last step)."""
    env.reset(ex)
    reward, actions = 0.0, []
    for _ in range(max_steps):
        a = expert(server, env)
        assert a is not None, f"the expert is stuck after {actions}"
        actions.append(a)
        res = env.step(a)
        reward += res.reward
        if res.done:
            return reward, actions, res.info
    raise AssertionError(f"not done after {actions}")


