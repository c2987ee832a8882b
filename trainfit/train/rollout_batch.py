"""What the RL stages (grpo.py, ppo.py) share around the engine: pushing weights to it (before a rollout
and before an evaluation), sampling one completion per given example and scoring it with the task's
reward functions, and logging a few completions per step.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from trainfit.config import Config, ConfigError
from trainfit.data.image_examples import encode_image_prompt, example_images
from trainfit.data.text import encode_prompt
from trainfit.models.logprobs import single_turn_sample
from trainfit.rollout.sync_check import check_sync
from trainfit.tasks import score
from trainfit.core.heap import cpu_heap_for_decoding
from trainfit.train import memstats, parallel, zero


@contextmanager
def rollout_round(model, engine, cfg: Config):
    """One rollout round of GRPO's or PPO's `prepare`: the train states put to sleep before the engine wakes
    (distributed.offload_train_states_during_rollout), the weights as the rollout reads them (ZeRO-3 gathered
    whole for the hf engine only: parallel.rollout_weights) and, at the end, the engine asleep (vllm sleep
    mode; a no-op for hf) before the states come back. Yields the states (`generation_over` wakes them early)."""
    states = parallel.states_asleep(model, cfg)
    states.sleep()
    with cpu_heap_for_decoding(), parallel.rollout_weights(model, cfg):
        try:
            yield states
        finally:
            engine.sleep()  # give the card back to training
            states.wake()


def generation_over(engine, states) -> None:
    """Generation is over: with the train states asleep, the engine sleeps first so that they come back,
    before the scoring forwards, to a card without its KV cache. Nothing without them (the async worker's
    engine keeps sampling)."""
    if states.asleep:
        engine.sleep()
        states.wake()


def sync_engine(engine, model, tokenizer, device, cfg: Config, step: Optional[int]) -> dict:
    """Push the current weights to the engine and prove it samples from them (rollout.sync_check), before
    optimizer step `step` + 1 (None: before an evaluation). Returns the probe's metrics ({} when no probe ran)."""
    engine.wake()
    if engine.shares_weights and cfg.rollout.sync_check != "always":
        return {}
    with zero.gathered_trainable(model):   # ZeRO-3: an adapter sync saves them whole (vllm gathers the rest itself)
        engine.sync(model)
    r = cfg.rollout
    if r.sync_check == "never":
        return {}
    report = check_sync(engine, model, tokenizer, device, n_prompts=r.sync_probe_prompts,
                        tolerance=r.sync_tolerance,
                        what=f" before step {step + 1}" if step is not None else " before an evaluation")
    return {"sync_logp_diff": report.mean_abs_diff, "sync_logp_diff_max": report.max_abs_diff}


@contextmanager
def current_engine(engine, model, tokenizer, device, cfg: Config, sleep_after: bool = True):
    """The engine as an evaluation needs it: holding the trainer's weights now.
    An engine with its own copy (vllm, openai) last got them before the rollout that these steps trained
    on, and vllm's sleep mode put it to sleep after that rollout: the weights are pushed (and probed, as
    before a rollout) and it is put back to sleep after (not with `sleep_after` False: an async worker
    samples with it next). The hf engine samples from the trainer's module itself: nothing to do; neither
    is there with no held-out examples (task.num_eval = 0)."""
    if engine.shares_weights or cfg.task.num_eval == 0:
        yield
        return
    sync_engine(engine, model, tokenizer, device, cfg, None)
    try:
        yield
    finally:
        if sleep_after:
            engine.sleep()


def sample_and_score(engine, tokenizer, cfg: Config, flat_ex: list, seeds: list[int], reward_fns, weights,
                     vision=None):
    """One completion per entry of `flat_ex` (a GRPO group repeats its example), sampled with its seed
    and scored by the weighted reward functions. Returns (samples, texts, total [N], {name: [N]},
    finished [N]); samples are `single_turn_sample` dicts (prompt 0s, completion 1s). With `vision`
    (a VisionProcessor) examples may carry images: their prompts hold the image tokens (never cut: a
    prompt over rollout.max_prompt_length is a ConfigError) and their samples keep `images`."""
    limit, chat = cfg.rollout.max_prompt_length, cfg.task.chat
    prompts: dict = {}  # a group's G rows share one example: tokenize it once
    for ex in flat_ex:
        if id(ex) not in prompts:
            if vision is not None and example_images(ex):
                prompts[id(ex)] = encode_image_prompt(tokenizer, vision, ex, chat)
                if len(prompts[id(ex)]) > limit:
                    raise ConfigError(f"a prompt with images is {len(prompts[id(ex)])} tokens, over "
                                      f"rollout.max_prompt_length={limit}, and cutting it could cut an image; "
                                      "raise rollout.max_prompt_length or lower model.max_pixels.")
            else:
                prompts[id(ex)] = encode_prompt(tokenizer, ex, chat)[-limit:]
    flat_prompts = [prompts[id(ex)] for ex in flat_ex]
    flat_images = [example_images(ex) for ex in flat_ex] if vision is not None else []
    with memstats.phase("rollout", "generate"):
        kw = {"images": flat_images} if any(flat_images) else {}
        outs = engine.generate(flat_prompts, seeds=seeds, **kw)
    texts = [o.text for o in outs]
    prompts_for_rewards = [ex.prompt if ex.prompt is not None else ex.messages for ex in flat_ex]
    with memstats.phase("scoring", "rewards"):
        if reward_fns:
            total, per_fn = score(reward_fns, weights, prompts_for_rewards, texts, flat_ex)   # [N]
        else:  # PPO scored by a reward model alone
            total, per_fn = torch.zeros(len(texts)), {}
    samples = [single_turn_sample(p, o.token_ids) for p, o in zip(flat_prompts, outs)]
    for s, ims in zip(samples, flat_images):
        if ims:
            s["images"] = ims   # the trainer's forwards need them (data/image_examples.image_inputs)
    finished = torch.tensor([float(o.finished) for o in outs])
    return samples, texts, total, per_fn, finished


def log_completions(path: Path, n: int, step: int, examples, texts, rewards) -> None:
    """The first `n` completions of a step, one JSON line each, appended to `path`."""
    if not n:
        return
    with open(path, "a") as f:
        for ex, t, r in list(zip(examples, texts, rewards.tolist()))[:n]:
            f.write(json.dumps({"step": step + 1, "prompt": ex.prompt or ex.messages,
                                "completion": t, "answer": ex.answer, "reward": r}) + "\n")
