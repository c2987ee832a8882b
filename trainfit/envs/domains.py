"""Task rows grouped by `domain`: the selection `env.domains` / `env.tasks_per_domain` make, and the
keyword reward that `default` means for simulated-user conversations.

A JSONL task already keeps every row field in `Example.fields`; `DomainTask` wraps it, keeps the rows
of the chosen domains (a seeded sample of `tasks_per_domain` each) and cycles through them.
"""

from __future__ import annotations

import json
import random
from typing import Optional, Sequence

from trainfit.config import ConfigError
from trainfit.tasks.base import EpochShuffle, Example, Task


def required_keywords(answer: str, keywords: Optional[Sequence[str]]) -> list[str]:
    """The row's `keywords` list, else its answer split on `|` ("refund|7 days" -> two keywords)."""
    if keywords:
        return [str(k) for k in keywords]
    return [a.strip() for a in str(answer).split("|") if a.strip()]


def keyword_reward(prompts: list, completions: list[str], answer: list, keywords: Optional[list] = None,
                   **fields: list) -> list[float]:
    """Fraction of the row's required keywords the agent wrote (case-insensitive)."""
    kws = keywords if keywords is not None else [None] * len(completions)
    out = []
    for c, a, k in zip(completions, answer, kws):
        need = required_keywords(a, k)
        text = c.lower()
        out.append(sum(w.lower() in text for w in need) / len(need) if need else 0.0)
    return out


def select_examples(examples: Sequence[Example], domains: Sequence[str], tasks_per_domain: int,
                    seed: int) -> list[Example]:
    """Rows of `domains` (all when empty), at most `tasks_per_domain` per domain (0 = all), seeded."""
    by: dict[str, list[Example]] = {}
    for ex in examples:
        by.setdefault(str(ex.fields.get("domain")), []).append(ex)
    wanted = list(domains) or sorted(by)
    missing = [d for d in wanted if d not in by]
    if missing:
        raise ConfigError(f"env.domains names {missing}, which no task row has in its `domain` field; the rows' "
                          f"domains are {sorted(by)}.")
    out = []
    for d in wanted:
        # Sorted by content first, so the sample does not depend on the order the task yields rows.
        rows = sorted(by[d], key=lambda e: json.dumps(e.fields, sort_keys=True, default=str))
        if tasks_per_domain and tasks_per_domain < len(rows):
            rows = random.Random(f"trainfit-domains|{seed}|{d}").sample(rows, tasks_per_domain)
        out.extend(rows)
    return out


class DomainTask(Task):
    """A finite task restricted to some domains' rows; its `default` reward is `keyword_reward`."""

    def __init__(self, base: Task, domains: Sequence[str], tasks_per_domain: int):
        super().__init__(seed=base.seed, num_eval=base.num_eval, chat=base.chat)
        if not base.num_train:
            raise ConfigError(f"env.type=simulated_user needs a task with a finite list of rows (task.name=jsonl); "
                              f"task {base.name} generates an endless stream.")
        self.base, self.name = base, base.name
        self.domains, self.tasks_per_domain = list(domains), tasks_per_domain
        rows = [base.train_example(i) for i in range(base.num_train)]
        self._train = select_examples(rows, domains, tasks_per_domain, base.seed)
        self.num_train = len(self._train)
        wanted = set(self.domains)
        self._eval = [e for e in base.eval_examples() if not wanted or str(e.fields.get("domain")) in wanted]
        self._order = EpochShuffle(self.num_train, f"trainfit-domains|{self.seed}")

    def train_example(self, i: int) -> Example:
        return self._train[self._order(i)]

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def is_correct(self, completion: str, ex: Example) -> bool:
        need = required_keywords(ex.answer, ex.fields.get("keywords"))
        return bool(need) and all(w.lower() in completion.lower() for w in need)

    def reward_funcs(self):
        return [("keywords", keyword_reward)]

    def stop_strings(self) -> list[str]:
        return self.base.stop_strings()

