"""Multi-turn environments for GRPO: tool use, a simulated user, and remote services over HTTP.

    task = env_task(cfg, build_task(cfg.task))        # simulated_user: the chosen domains' rows
    make_env = build_env_factory(cfg, task, model, tokenizer, is_peft, device)
    episodes = run_episodes(make_env, examples, engine, tokenizer, seeds=seeds,
                            max_turns=cfg.rollout.max_turns, max_new_tokens=cfg.rollout.max_new_tokens,
                            max_prompt_length=cfg.rollout.max_prompt_length,
                            max_episode_tokens=cfg.rollout.max_episode_tokens,
                            max_observation_tokens=cfg.env.max_observation_tokens)
    samples = [{"input_ids": e.input_ids, "loss_mask": e.loss_mask} for e in episodes]
    rewards = [e.reward for e in episodes]            # one per episode; a group = G episodes of one task
    f.write(json.dumps(transcript_record(step, e)) + "\\n")   # transcripts.jsonl
"""

from __future__ import annotations

from typing import Callable

from trainfit.config import Config, ConfigError
from trainfit.models.policy import load_base_model, load_tokenizer
from trainfit.tasks import resolve_rewards, resolve_weights

from .base import BaseEnv, Environment, EnvError, StepResult
from .domains import DomainTask, keyword_reward, select_examples
from .episodes import Episode, run_episodes, turn_seed
from .groups import run_groups
from .http import HTTPEnv
from .render import ChatRenderer
from .simulated_user import DONE, SimulatedUserEnv, UserSimulator
from .tools import ToolEnv, calculator, load_tools, parse_tool_calls, safe_eval


def env_task(cfg: Config, task):
    """The task episodes draw from: for simulated_user, `task` restricted to env.domains /
    env.tasks_per_domain (whose `default` reward is the keyword reward); otherwise `task` itself."""
    if cfg.env.type != "simulated_user" or isinstance(task, DomainTask):
        return task
    return DomainTask(task, cfg.env.domains, cfg.env.tasks_per_domain)


def _user_simulator(cfg: Config, model, tokenizer, is_peft: bool, device) -> UserSimulator:
    e = cfg.env
    common = dict(max_new_tokens=e.user_max_new_tokens, temperature=e.user_temperature, seed=cfg.train.seed)
    if e.user_model is None:
        # The policy's own module; adapters are switched off around each user turn (one copy in memory).
        return UserSimulator(model, tokenizer, shares_policy=True, is_peft=is_peft, **common)

    mc = cfg.model.model_copy(update={"name": e.user_model, "gguf_file": None, "revision": None,
                                      "quantization": "none", "gradient_checkpointing": False})
    user_tok = load_tokenizer(mc)
    user_model, _ = load_base_model(mc, device, vocab_size=len(user_tok))
    user_model.eval().requires_grad_(False)
    user_model.config.pad_token_id = user_tok.pad_token_id
    return UserSimulator(user_model, user_tok, shares_policy=False, **common)


def build_env_factory(cfg: Config, task, model, tokenizer, is_peft: bool, device) -> Callable[[], Environment]:
    """A function that makes one fresh environment per episode, chosen by `cfg.env.type`.

    Expensive parts (tool schemas, reward functions, the user model, the HTTP client) are built once here
    and shared by every environment the factory makes.
    """
    e = cfg.env
    if e.type == "none":
        raise ConfigError("env.type=none runs single-turn GRPO, which needs no environment; set env.type to "
                          "tools, simulated_user or http for multi-turn episodes.")
    if e.type == "http":
        if not e.url:
            raise ConfigError("env.type=http needs env.url, the environment service's base URL.")
        from .http import make_client

        client = make_client(e.api_key_env, e.timeout_s)
        return lambda: HTTPEnv(e.url, timeout_s=e.timeout_s, retries=e.retries, backoff_s=e.backoff_s,
                               retry_max_s=e.retry_max_s, client=client)
    task = env_task(cfg, task)
    fns, weights = resolve_rewards(cfg.task, task), resolve_weights(cfg.task, task)
    if e.type == "tools":
        tools = load_tools(e.tools)
        return lambda: ToolEnv(tools, fns, weights)
    if e.type == "simulated_user":
        user = _user_simulator(cfg, model, tokenizer, is_peft, device)
        return lambda: SimulatedUserEnv(user, fns, weights)
    raise ConfigError(f"Unknown env.type {e.type!r}; valid types are none, tools, simulated_user, http.")


def transcript_record(step: int, episode: Episode) -> dict:
    """One transcripts.jsonl line: the conversation, where its tokens came from, and how it ended."""
    tokens = {}
    for source, n in episode.segments:
        tokens[source] = tokens.get(source, 0) + n
    return {"step": step, "reward": episode.reward, "turns": episode.turns, "done": episode.done,
            "failed": episode.failed, "error": episode.error, "end": episode.info.get("end"),
            "messages": episode.messages,
            # Per-token roles, run-length: [["prompt", 41], ["policy", 12], ["template", 1], ["env", 30], ...].
            "token_roles": [list(s) for s in episode.segments], "tokens": tokens,
            "policy_tokens": episode.policy_tokens(), "total_tokens": len(episode.input_ids),
            "training_rows": len(episode.rows()),
            "info": {k: v for k, v in episode.info.items() if k != "end"}}


__all__ = ["DONE", "BaseEnv", "ChatRenderer", "DomainTask", "EnvError", "Environment", "Episode", "HTTPEnv",
           "SimulatedUserEnv", "StepResult", "ToolEnv", "UserSimulator", "build_env_factory", "calculator",
           "env_task", "keyword_reward", "load_tools", "parse_tool_calls", "run_episodes", "safe_eval",
           "run_groups", "select_examples", "transcript_record", "turn_seed"]
