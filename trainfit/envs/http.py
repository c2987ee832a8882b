"""An environment served over HTTP (a computer-use sandbox, a game server, a remote tool runtime).

Protocol (JSON over HTTP POST; every request carries `Authorization: Bearer <key>` when the variable
named by `env.api_key_env` is set):

    POST {url}/reset  {"task": {"prompt": ..., "messages": ..., "answer": ..., <every task row field>}}
      -> {"episode_id": "<str>", "observation": [{"role": "...", "content": "..."}, ...],
          "tools": [<JSON schema>, ...]}            # tools optional: rendered by the chat template
    POST {url}/step   {"episode_id": "<str>", "step": <1, 2, ...>, "action": "<the policy's reply text>"}
      -> {"observation": [<new messages>], "reward": <float>, "done": <bool>, "info": {...}}   # info optional
    POST {url}/close  {"episode_id": "<str>"}          # optional; any reply (or 404) is fine

`observation` of /reset is the opening chat; that of /step holds only the messages after the action.
Images (screenshots, for vision-language policies): a message's `content` may be a list of parts,
`{"type": "text", "text": "..."}` and `{"type": "image", "image": "<base64 PNG>"}` (or OpenAI's
`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`), in reading order;
trainfit/data/image_parts.py decodes them (transcripts keep their sha256, not the bytes).
Each request may take `env.timeout_s`. A service that is dead (connection refused or reset), hangs, or
answers 408, 429 or 5xx (honouring its Retry-After), and a reply that is not JSON of the shape above, are
retried up to `env.retries` times with exponential backoff from `env.backoff_s` (trainfit/core/retry.py),
all within `env.retry_max_s`. A service still unreachable after that raises EnvLost naming the URL and
what was tried; so does a 404 to /step, which means the service no longer knows the episode (it
restarted): the episode's whole group is then sampled again (trainfit/envs/groups.py). Other 4xx are
not retried and fail only their episode; 410 Gone is how a service says it ended the episode itself
(e.g. its browser crashed), with the reason in the body. Because a request may be retried after the
service acted on it, /step should be idempotent in (episode_id, step): answer a repeated step with the
reply it gave the first time.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import httpx

from trainfit.core.errors import EnvLost
from trainfit.core.retry import GaveUp, Invalid, RetryPolicy, send
from trainfit.data.image_parts import decode_observation, parts_problem

from .base import BaseEnv, EnvError, StepResult


def task_payload(example) -> dict:
    """The example as JSON: prompt / messages / answer plus every row field (non-JSON values as str)."""
    task = {**example.fields, "prompt": example.prompt, "messages": example.messages, "answer": example.answer}
    return json.loads(json.dumps(task, default=str))


def _messages_problem(obs) -> Optional[str]:
    if not isinstance(obs, list):
        return f"`observation` must be a list of messages, got {type(obs).__name__}"
    for i, m in enumerate(obs):
        if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), list):
            bad = parts_problem(m["content"])   # text and image parts (data/image_parts.py)
            if bad:
                return f"observation[{i}]: {bad}"
            continue
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"observation[{i}] must be an object with string `role` and `content`, got {m!r:.120}"
    return None


def _reset_problem(body) -> Optional[str]:
    if not isinstance(body, dict):
        return f"expected a JSON object, got {type(body).__name__}"
    if not isinstance(body.get("episode_id"), (str, int)) or isinstance(body.get("episode_id"), bool):
        return "missing `episode_id` (a string)"
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        return "`tools` must be a list of JSON schemas"
    return _messages_problem(body.get("observation"))


def _step_problem(body) -> Optional[str]:
    if not isinstance(body, dict):
        return f"expected a JSON object, got {type(body).__name__}"
    r = body.get("reward")
    if not isinstance(r, (int, float)) or isinstance(r, bool):
        return f"`reward` must be a number, got {r!r:.60}"
    if not isinstance(body.get("done"), bool):
        return f"`done` must be true or false, got {body.get('done')!r:.60}"
    if body.get("info") is not None and not isinstance(body["info"], dict):
        return "`info` must be an object"
    return _messages_problem(body.get("observation"))


def make_client(api_key_env: str, timeout_s: float) -> httpx.Client:
    """One client (thread-safe, pooled connections) for all episodes of a run."""
    key = os.environ.get(api_key_env)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(timeout=timeout_s, headers=headers)


class HTTPEnv(BaseEnv):
    def __init__(self, url: str, *, api_key_env: str = "TRAINFIT_ENV_API_KEY", timeout_s: float = 30.0,
                 retries: int = 8, backoff_s: float = 0.5, retry_max_s: float = 120.0,
                 client: Optional[httpx.Client] = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.policy = RetryPolicy(timeout_s, retries, backoff_s, max(retry_max_s, timeout_s))
        self.owns_client = client is None
        self.client = client or make_client(api_key_env, timeout_s)
        self.episode_id: Optional[str] = None
        self.steps = 0

    def reset(self, example) -> list[dict]:
        body = self._post("reset", {"task": task_payload(example)}, _reset_problem)
        self.episode_id, self.steps = str(body["episode_id"]), 0
        self.tools = body.get("tools") or None
        return decode_observation(body["observation"], f"{self.url}/reset")

    def step(self, action: str) -> StepResult:
        self.steps += 1
        body = self._post("step", {"episode_id": self.episode_id, "step": self.steps, "action": action}, _step_problem)
        return StepResult(decode_observation(body["observation"], f"{self.url}/step"), float(body["reward"]),
                          body["done"], body.get("info") or {})

    def close(self) -> None:
        try:
            if self.episode_id is not None:  # best effort: the service may not implement /close
                self.client.post(f"{self.url}/close", json={"episode_id": self.episode_id},
                                 timeout=min(self.timeout_s, 5.0))
        except httpx.HTTPError:
            pass
        finally:
            self.episode_id = None
            if self.owns_client:
                self.client.close()

    def _post(self, path: str, payload: dict, problem: Callable[[object], Optional[str]]) -> dict:
        url = f"{self.url}/{path}"

        def read(r: httpx.Response) -> dict:
            if r.status_code == 404 and path != "reset":
                raise EnvLost(f"environment service at {url} no longer knows episode {self.episode_id!r} (HTTP 404: "
                              f"{r.text[:200]}); it restarted or dropped the episode, so its group is sampled again.")
            if r.status_code >= 400:
                hint = ("check the key in the variable named by env.api_key_env" if r.status_code in (401, 403)
                        else "the service ended this episode (see its reason); the other episodes go on"
                        if r.status_code == 410
                        else "the request is what trainfit/envs/http.py documents; check the service's version")
                raise EnvError(f"environment service at {url} rejected the request with HTTP {r.status_code}: "
                               f"{r.text[:200]}; {hint}.")
            try:
                body = r.json()
            except ValueError as e:
                raise Invalid(f"the reply is not JSON ({e}): {r.text[:120]!r}") from None
            bad = problem(body)
            if bad is not None:
                raise Invalid(f"invalid reply: {bad}")
            return body

        try:
            return send(self.client, "POST", url, self.policy, read=read, json=payload)
        except GaveUp as e:
            p = self.policy
            limits = f"env.retries={p.retries}, env.timeout_s={p.timeout_s:g}, env.retry_max_s={p.max_s:g}"
            if e.state == "invalid":
                raise EnvError(f"environment service at {url} gave no valid reply: {e.tried()}; the service must "
                               f"answer as trainfit/envs/http.py documents ({limits}).") from None
            raise EnvLost(f"environment service at {url} {e.state}: {e.tried()}; check env.url and that the service "
                          f"is running (its logs say why it {'failed' if e.state == 'failing' else 'stopped answering'}), "
                          f"or allow a longer restart than these settings wait out ({p.outage_s():.0f} s at least) "
                          f"with env.retries and env.retry_max_s ({limits}).") from None
