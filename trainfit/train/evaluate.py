"""Held-out evaluation: greedy accuracy on a task (its own `is_correct`), the run's reward functions
on the same completions, and eval loss on data."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from trainfit.data.image_examples import encode_image_prompt, example_images
from trainfit.data.text import collate, encode_prompt
from trainfit.envs import run_groups
from trainfit.models.images import VisionProcessor
from trainfit.models.logprobs import label_logprobs
from trainfit.tasks import score


def task_accuracy(engine, tokenizer, task, chat: bool, batch_size: int = 64,
                  rewards: Optional[tuple[Sequence, Sequence[float]]] = None) -> dict[str, float]:
    """Greedy-decode every held-out example once and judge it with the task's own evaluation.

    With `rewards` = (reward functions as `resolve_rewards` gives them, their weights), the same
    completions are also scored by the run's rewards: `eval_reward/<name>` is each one's held-out
    mean and `eval_reward` their weighted sum's mean (the number GRPO maximises).
    """
    examples = task.eval_examples()
    if not examples:
        return {}
    prompts = [encode_prompt(tokenizer, ex, chat) for ex in examples]
    outs = engine.generate(prompts, greedy=True, batch_size=batch_size)
    texts = [o.text for o in outs]
    correct = [task.is_correct(t, ex) for t, ex in zip(texts, examples)]
    out = {"accuracy": sum(correct) / len(correct), "eval_completion_len": sum(len(o.token_ids) for o in outs) / len(outs)}
    if rewards is not None and len(rewards[0]):
        reward_prompts = [ex.prompt if ex.prompt is not None else ex.messages for ex in examples]
        total, per_fn = score(rewards[0], rewards[1], reward_prompts, texts, examples)              # [n] each
        out["eval_reward"] = total.mean().item()
        out.update({f"eval_reward/{name}": r.mean().item() for name, r in per_fn.items()})
    return out


@torch.no_grad()
def eval_loss(model, items: list[dict], pad_id: int, batch_size: int, collate_fn=None,
              inputs_of=None) -> dict[str, float]:
    """Token-mean NLL over held-out items (SFT / pretrain data). `collate_fn(items)` builds a batch
    (default: `data.collate`) and `inputs_of(batch)` its further forward arguments (a vision-language
    batch's image inputs: data/image_chat.py collate_vlm and model_inputs)."""
    if not items:
        return {}
    collate_fn = collate_fn or (lambda chunk: collate(chunk, pad_id))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(items), batch_size):
        b = {k: v.to(device) for k, v in collate_fn(items[i:i + batch_size]).items()}
        logp = label_logprobs(model, b["input_ids"], b["attention_mask"], b["labels"], 0,
                              inputs_of(b) if inputs_of else None)                          # [n]
        total -= float(logp.sum())
        count += logp.numel()
    model.train(was_training)
    return {"eval_loss": total / max(count, 1)}


def episode_eval(make_env, engine, tokenizer, task, cfg, judge_final: bool) -> dict[str, float]:
    """Greedy multi-turn episodes on every held-out example: mean environment reward, and (tool use,
    where the last assistant message is the answer) accuracy by the task's own `is_correct`.

    An environment whose step infos say `success` (the MiniWoB++ service: MiniWoB ended the task with a
    positive reward) gives `success`, the fraction of episodes that succeeded (a failed episode counts as
    no success); without a final-answer judge it is also the `accuracy` the run's summary chains. An
    episode lost to a restarted service (envs/groups.py) is played again, up to env.group_retries times,
    instead of counting as a failure of the policy."""
    examples = task.eval_examples()
    if not examples:
        return {}
    r = cfg.rollout
    eps = run_groups(make_env, examples, engine, tokenizer, seeds=list(range(len(examples))), greedy=True,
                     group_size=1, group_retries=cfg.env.group_retries,
                     why="held-out scores never count an episode the service lost as the policy's failure",
                     max_turns=r.max_turns, max_new_tokens=r.max_new_tokens, max_prompt_length=r.max_prompt_length,
                     max_episode_tokens=cfg.episode_tokens(), max_observation_tokens=cfg.env.max_observation_tokens,
                     processor=getattr(engine, "processor", None), max_images=r.max_images_per_episode)
    out = {"eval_reward": sum(e.reward for e in eps) / len(eps),
           "eval_turns": sum(e.turns for e in eps) / len(eps),
           "eval_env_failed": sum(e.failed for e in eps) / len(eps)}
    if any("success" in e.info for e in eps):
        out["success"] = sum(bool(e.info.get("success")) and not e.failed for e in eps) / len(eps)
        if not judge_final:
            out["accuracy"] = out["success"]
    if judge_final:
        finals = [next((m["content"] for m in reversed(e.messages) if m["role"] == "assistant"), "") for e in eps]
        out["accuracy"] = sum(task.is_correct(f, ex) for f, ex in zip(finals, examples)) / len(eps)
    return out


def image_task_accuracy(engine, tokenizer, proc: VisionProcessor, task, chat: bool, batch_size: int = 64,
                        rewards=None) -> dict[str, float]:
    """train/evaluate.task_accuracy for a task whose prompts carry images: greedy, held-out examples,
    judged by the task's own `is_correct` (and scored by the run's rewards when given)."""
    examples = task.eval_examples()
    if not examples:
        return {}
    prompts = [encode_image_prompt(tokenizer, proc, ex, chat) for ex in examples]
    outs = engine.generate(prompts, greedy=True, batch_size=batch_size, images=[example_images(ex) for ex in examples])
    texts = [o.text for o in outs]
    correct = [task.is_correct(t, ex) for t, ex in zip(texts, examples)]
    out = {"accuracy": sum(correct) / len(correct),
           "eval_completion_len": sum(len(o.token_ids) for o in outs) / len(outs)}
    if rewards is not None and len(rewards[0]):
        reward_prompts = [ex.prompt if ex.prompt is not None else ex.messages for ex in examples]
        total, per_fn = score(rewards[0], rewards[1], reward_prompts, texts, examples)
        out["eval_reward"] = total.mean().item()
        out.update({f"eval_reward/{name}": r.mean().item() for name, r in per_fn.items()})
    return out
