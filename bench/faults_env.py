"""A deterministic HTTP environment for the harness's agent GRPO runs (trainfit's HTTP protocol, served by
trainfit.envs.service_http.EnvServer): the task's prompt opens the episode, a reply containing the answer
scores 1 and ends it, anything else is told to try again. Its rewards depend only on the actions, so a run
killed and resumed against it is compared with the uninterrupted one bit for bit.

    python -m bench.faults_env      # prints the service's URL on its first line, serves until killed
"""

from __future__ import annotations

import itertools
import sys
import threading
from typing import Optional

from trainfit.envs.service_http import EnvServer, Refused


class AnswerService:
    def __init__(self):
        self.episodes: dict[str, str] = {}
        self.replies: dict[tuple, tuple] = {}   # (episode, step) -> its answer: /step is idempotent
        self.ids = itertools.count()
        self.lock = threading.Lock()

    def reset(self, task) -> dict:
        if not isinstance(task, dict) or "answer" not in task:
            raise Refused(400, "the task needs an `answer`.")
        with self.lock:
            episode = f"ep-{next(self.ids)}"
            self.episodes[episode] = str(task["answer"])
        return {"episode_id": episode, "observation": [{"role": "user", "content": f"{task.get('prompt', '')} "
                                                                                   "Reply with the number."}]}

    def step(self, body: dict) -> tuple[int, dict]:
        key = (body.get("episode_id"), body.get("step"))
        with self.lock:
            answer = self.episodes.get(key[0])
            if answer is None:
                return 404, {"error": f"no episode {key[0]!r}"}
            if key not in self.replies:
                hit = answer in str(body.get("action", ""))
                self.replies[key] = (200, {"observation": [] if hit else [{"role": "user", "content": "No, again."}],
                                           "reward": 1.0 if hit else 0.0, "done": hit, "info": {}})
            return self.replies[key]

    def close(self, body: dict) -> dict:
        with self.lock:
            self.episodes.pop(body.get("episode_id"), None)
        return {}

    def expert(self, body: dict) -> dict:
        raise Refused(404, "this service has no expert.")

    def close_idle(self) -> int:
        return 0

    def health(self) -> dict:
        return {"ok": True, "episodes": len(self.episodes)}

    def authorised(self, header: Optional[str], key: Optional[str]) -> bool:
        return key is None or header == f"Bearer {key}"


def main() -> None:
    server = EnvServer(AnswerService())
    print(server.url, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
