"""Multi-turn episodes as token sequences where only the policy's own tokens carry loss.

    episodes = run_episodes(make_env, examples, engine, tokenizer, seeds=seeds, max_turns=4,
                            max_new_tokens=128, max_prompt_length=512)
    sample = {"input_ids": ep.input_ids, "loss_mask": ep.loss_mask}     # what GRPO trains on

All episodes advance in lock-step: each turn is ONE `engine.generate` call for every live episode,
then every live environment steps (in a thread pool: remote environments are slow). With `as_ready`
(the asynchronous rollout worker's episodes) each episode goes on as soon as its environment answers: one
engine call samples every episode whose environment has answered while the others' turns are in flight,
so a slow turn holds up only its own episode; each turn's seed is its episode's own, so the tokens are
the same either way. An episode is

    [prompt: template(reset messages) + generation prompt]            loss 0, last max_prompt_length kept
    [policy turn 1: the sampled ids exactly as the engine gave them]  loss 1
    [end-of-turn ids the completion did not produce]                  loss 0
    [observation 1: template delta of the env's messages]             loss 0, <= max_observation_tokens
    [policy turn 2] ...

It ends when the environment says done, after `max_turns` policy turns, or when it would pass
`max_episode_tokens`. An environment that raises marks only its episode failed (reward 0, all-zero
loss mask, the error kept); the other episodes go on.

Observations with images (screenshots; data/image_parts.py) need `processor`: each image is its
vision tokens in the sequence (loss 0), `Episode.images` holds the images in sequence order (what the
trainer's forwards get) and `max_images` (rollout.max_images_per_episode) drops the oldest when passed.
An observation holding images is not cut to max_observation_tokens (cutting could split an image);
an opening prompt holding images is not cut to max_prompt_length.

A dropped screenshot changes the context of every policy turn sampled after it, so those turns must
not be trained under the shorter sequence: before a drop, the sequence as it stands (ending with the
latest policy turn) is sealed as a `Piece` that keeps its loss mask, and in the sequence that goes on
those turns become context (loss 0). The trainer trains `Episode.rows()`: the pieces, then the final
sequence, each policy token exactly once and each under the context it was sampled in:

    turn 1 sees [prompt + shot 1]; max_images 1, so shot 2 drops shot 1:
    piece 1:  [prompt][shot 1][turn 1]                                    loss at turn 1
    final:    [prompt][turn 1][obs: shot 2][turn 2]                       loss at turn 2
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from trainfit.core.errors import EnvLost
from trainfit.data.image_parts import (expand, message_images, oldest_image_span, public,
                                          with_vision_tokens)

from .base import EnvError, StepResult, check_messages
from .render import ChatRenderer


@dataclass
class Piece:
    """Policy turns sealed with the exact context they were sampled in (before a screenshot drop)."""
    input_ids: list[int]
    loss_mask: list[int]
    images: list
    logprobs: Optional[list[float]] = None


@dataclass
class Episode:
    input_ids: list[int]
    loss_mask: list[int]                          # 1 exactly at the policy's sampled tokens
    reward: float = 0.0                           # sum of step rewards (+ finish() when cut short)
    messages: list[dict] = field(default_factory=list)   # full transcript, policy turns decoded
    turns: int = 0                                # policy turns taken
    done: bool = False                            # the environment ended the episode
    failed: bool = False
    lost: bool = False                            # failed by EnvLost: its group is sampled again (envs/groups.py)
    error: Optional[str] = None
    info: dict = field(default_factory=dict)      # env step infos merged; "end": why it ended
    segments: list[list] = field(default_factory=list)   # [[source, n_tokens], ...]: prompt|policy|template|env
    logprobs: Optional[list[float]] = None        # engine log-prob per loss-mask-1 token (logprobs=True)
    images: list = field(default_factory=list)    # PIL images whose tokens are in input_ids, in order
    pieces: list[Piece] = field(default_factory=list)   # earlier turns sealed before a screenshot drop

    def rows(self) -> list[Piece]:
        """What the trainer trains: the sealed pieces, then the final sequence when it still holds a
        policy token (or when there is nothing else)."""
        final = Piece(self.input_ids, self.loss_mask, self.images, self.logprobs)
        return self.pieces + [final] if any(self.loss_mask) or not self.pieces else list(self.pieces)

    def policy_tokens(self) -> int:
        """The policy's sampled tokens over every row (each is trained exactly once)."""
        return sum(sum(p.loss_mask) for p in self.pieces) + sum(self.loss_mask)


def turn_seed(seed: int, turn: int) -> int:
    """Sampling seed of one policy turn; turn 0 keeps the episode's seed (single-turn GRPO's sample)."""
    if turn == 0:
        return int(seed)
    return int.from_bytes(hashlib.sha256(f"{seed}:{turn}".encode()).digest()[:8], "little") >> 2


class _Run:
    """One episode in progress: its environment, tokens and where it stands."""

    def __init__(self, example: Any, seed: int, want_logprobs: bool):
        self.example, self.seed = example, seed
        self.env = None
        self.renderer: Optional[ChatRenderer] = None
        self.ep = Episode([], [], logprobs=[] if want_logprobs else None)
        self.live = False

    def add(self, ids: list[int], source: str, loss: int) -> None:
        if not ids:
            return
        self.ep.input_ids.extend(ids)
        self.ep.loss_mask.extend([loss] * len(ids))
        segs = self.ep.segments
        if segs and segs[-1][0] == source:
            segs[-1][1] += len(ids)
        else:
            segs.append([source, len(ids)])

    def seal(self) -> None:
        """Keep the sequence as it stands, with its policy turns' loss, as a training row of its own;
        in the sequence that goes on they are context only (see the module docstring)."""
        ep = self.ep
        ep.pieces.append(Piece(list(ep.input_ids), list(ep.loss_mask), list(ep.images),
                               None if ep.logprobs is None else list(ep.logprobs)))
        ep.loss_mask = [0] * len(ep.loss_mask)
        if ep.logprobs is not None:
            ep.logprobs = []

    def end(self, reason: str, done: bool = False) -> None:
        self.live, self.ep.done = False, done
        self.ep.info["end"] = reason

    def fail(self, exc: BaseException) -> None:
        self.live = False
        ep = self.ep
        ep.failed, ep.reward, ep.loss_mask, ep.pieces = True, 0.0, [0] * len(ep.input_ids), []
        ep.error = str(exc) if isinstance(exc, EnvError) else f"{type(exc).__name__}: {exc}"
        ep.lost = isinstance(exc, EnvLost)
        ep.info["end"] = "failed"


def _call_all(pool: ThreadPoolExecutor, calls: list[Callable[[], Any]]) -> list[tuple[bool, Any]]:
    """Run calls concurrently; (True, value) or (False, exception) for each, in order."""
    futures = [pool.submit(c) for c in calls]
    out = []
    for f in futures:
        try:
            out.append((True, f.result()))
        except Exception as e:  # one environment's failure must not stop the others
            out.append((False, e))
    return out


def _check_step(res: Any) -> StepResult:
    if not isinstance(res, StepResult):
        raise EnvError(f"env.step must return a StepResult, got {type(res).__name__}.")
    check_messages(res.observation, "env.step observation")
    res.reward = float(res.reward)
    return res


def run_episodes(make_env: Callable[[], Any], examples: Sequence[Any], engine, tokenizer, *,
                 seeds: Sequence[int], max_turns: int, max_new_tokens: int, max_prompt_length: int,
                 max_episode_tokens: int = 0, max_observation_tokens: int = 256, logprobs: bool = False,
                 max_workers: int = 64, greedy: bool = False, processor=None, max_images: int = 0,
                 as_ready: bool = False) -> list[Episode]:
    """One episode per example (a GRPO group repeats an example G times, each with its own seed).
    `greedy` decodes the policy's turns greedily (held-out evaluation).

    `max_episode_tokens` 0 = max_prompt_length + max_turns * (max_new_tokens + max_observation_tokens).
    """
    if len(seeds) != len(examples):
        raise ValueError(f"run_episodes needs one seed per example: {len(seeds)} seeds, {len(examples)} examples.")
    budget = max_episode_tokens or max_prompt_length + max_turns * (max_new_tokens + max_observation_tokens)
    runs = [_Run(ex, s, logprobs) for ex, s in zip(examples, seeds)]
    renderers: dict[str, ChatRenderer] = {}

    def renderer_for(tools) -> ChatRenderer:
        key = repr(tools)
        if key not in renderers:  # template errors here are configuration errors: they propagate
            renderers[key] = ChatRenderer(tokenizer, tools)
        return renderers[key]

    def reset(r: _Run):
        r.env = make_env()
        return r.env.reset(r.example)

    pool = ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(runs))))
    try:
        for r, (ok, val) in zip(runs, _call_all(pool, [lambda r=r: reset(r) for r in runs])):
            if not ok:
                r.fail(val)
                continue
            try:
                msgs = check_messages(val, "env.reset")
                r.renderer = renderer_for(getattr(r.env, "tools", None))
                r.ep.messages = [public(m) for m in msgs]
                images = message_images(msgs) if processor is not None else []
                if images:  # kept whole: a cut could split an image
                    r.add(expand(r.renderer.prompt_ids(with_vision_tokens(msgs, processor)), images, processor),
                          "prompt", 0)
                    r.ep.images.extend(images)
                    _drop_oldest_images(r, processor, max_images)
                else:
                    r.add(r.renderer.prompt_ids(msgs)[-max_prompt_length:], "prompt", 0)
                r.live = True
            except EnvError as e:
                r.fail(e)
        def generate(batch: list[_Run]) -> list[tuple[_Run, str, bool]]:
            """One engine call for `batch` (each at its own turn and seed): (run, action, cut) per run."""
            shown = {"images": [list(r.ep.images) for r in batch]} if any(r.ep.images for r in batch) else {}
            outs = engine.generate([list(r.ep.input_ids) for r in batch],
                                   seeds=[turn_seed(r.seed, r.ep.turns) for r in batch],
                                   max_new_tokens=max_new_tokens, logprobs=logprobs, greedy=greedy, **shown)
            return [(r, *_take_turn(r, out, budget, tokenizer, engine)) for r, out in zip(batch, outs)]

        def ready(batch: list[_Run]) -> list[_Run]:
            """The runs of `batch` that take another turn (an episode at the token budget ends)."""
            for r in batch:
                if r.live and len(r.ep.input_ids) >= budget:
                    r.end("max_episode_tokens")
            return [r for r in batch if r.live]

        def step(r: _Run, a: str) -> StepResult:
            return _check_step(r.env.step(a))

        if as_ready:
            _as_ready(pool, ready([r for r in runs if r.live]), generate, ready, step, budget,
                      max_turns, max_observation_tokens, processor, max_images)
        for _ in range(0 if as_ready else max_turns):
            live = ready(runs)
            if not live:
                break
            turns = generate(live)
            steps = _call_all(pool, [lambda r=r, a=a: step(r, a) for r, a, _ in turns])
            for (r, _, was_cut), (ok, res) in zip(turns, steps):
                _after_step(r, ok, res, was_cut, budget, max_turns, max_observation_tokens, processor, max_images)
        for r in runs:  # every live episode took max_turns turns above; kept for clarity of `end`
            if r.live:
                r.end("max_turns")
        _finish_cut_short(pool, runs)
        return [r.ep for r in runs]
    finally:
        _call_all(pool, [r.env.close for r in runs if r.env is not None])
        pool.shutdown(wait=True)


def _take_turn(r: _Run, out, budget: int, tokenizer, engine) -> tuple[str, bool]:
    """Add the engine's completion `out` to the episode as the policy's turn; (its text, cut at the budget)."""
    room = budget - len(r.ep.input_ids)
    ids, text = list(out.token_ids), out.text
    if len(ids) > room:  # autoregressive: the first `room` tokens are what a shorter limit gives
        ids = ids[:room]
        text = tokenizer.decode(ids, skip_special_tokens=True)
    cut = len(ids) < len(out.token_ids) or len(r.ep.input_ids) + len(ids) >= budget
    r.add(ids, "policy", 1)
    if r.ep.logprobs is not None:
        if out.logprobs is None or len(out.logprobs) < len(ids):
            raise RuntimeError(f"engine {getattr(engine, 'name', engine)!r} was asked for log-probs "
                               "and returned none (or fewer than its tokens).")
        r.ep.logprobs.extend(out.logprobs[:len(ids)])
    r.ep.messages.append({"role": "assistant", "content": text})
    r.ep.turns += 1
    return text, cut


def _after_step(r: _Run, ok: bool, res, was_cut: bool, budget: int, max_turns: int, limit: int, processor,
                max_images: int) -> None:
    """The environment's answer to the episode's last turn: its reward, and the end or the next observation."""
    if not ok:
        r.fail(res)
        return
    r.ep.reward += res.reward
    r.ep.info.update(res.info)
    if res.done:
        r.ep.messages.extend(public(m) for m in res.observation)
        r.end("done", done=True)
    elif was_cut:
        r.ep.messages.extend(public(m) for m in res.observation)
        r.end("max_episode_tokens")
    elif r.ep.turns >= max_turns:
        r.ep.messages.extend(public(m) for m in res.observation)
        r.end("max_turns")
    else:
        _append_observation(r, res.observation, budget, limit, processor, max_images)


def _as_ready(pool: ThreadPoolExecutor, first: list[_Run], generate, ready, step, budget: int, max_turns: int,
              limit: int, processor, max_images: int) -> None:
    """Episodes that advance on their own: the engine samples, in one call, every episode whose environment
    has answered, while the others' environment turns are still in flight, so a slow turn holds up only its
    own episode. Each turn is sampled with its episode's own seed (turn_seed), so an episode's tokens do not
    depend on which episodes share its call. Once one environment answers, the others in flight get as long
    again as it took, so turns of similar speed still share one engine call."""
    waiting, stepping, sent = first, {}, {}
    while waiting or stepping:
        if waiting:
            for r, a, was_cut in generate(waiting):
                f = pool.submit(step, r, a)
                stepping[f], sent[f] = (r, was_cut), time.monotonic()
            waiting = []
        done, rest = wait(list(stepping), return_when=FIRST_COMPLETED)
        if rest:
            quickest = time.monotonic() - max(sent[f] for f in done)
            done |= wait(rest, timeout=quickest)[0]
        answered = []
        for f in [f for f in stepping if f in done]:   # in submission order
            (r, was_cut), _ = stepping.pop(f), sent.pop(f)
            err = f.exception()
            _after_step(r, err is None, f.result() if err is None else err, was_cut, budget, max_turns, limit,
                        processor, max_images)
            answered.append(r)
        waiting = ready(answered)


def _append_observation(r: _Run, observation: list[dict], budget: int, limit: int, processor=None,
                        max_images: int = 0) -> None:
    """Close the policy's turn and add the env's reply (loss 0), or end the episode if it cannot fit."""
    images = message_images(observation) if processor is not None else []
    try:
        if images:  # not cut: cutting could split an image (the image budget bounds these instead)
            obs_ids = expand(r.renderer.observation_ids(with_vision_tokens(observation, processor)), images, processor)
            seen, truncated = observation, False
        else:
            obs_ids, seen, truncated = r.renderer.fit_observation(observation, limit)
    except EnvError as e:
        r.fail(e)
        return
    r.ep.messages.extend(public(m) for m in seen)
    if truncated:
        r.ep.info["observations_truncated"] = r.ep.info.get("observations_truncated", 0) + 1
    close = r.renderer.close_after(r.ep.input_ids)
    # +1: the next turn needs room for at least one policy token; what counts is the sequence once the
    # image budget has dropped the oldest screenshots, not before.
    n_images = len(r.ep.images) + len(images)
    drops = bool(max_images) and n_images > max_images   # the image budget drops the oldest after this reply
    after = (_kept_length(r.ep.input_ids + close + obs_ids, n_images, processor, max_images) if drops
             else len(r.ep.input_ids) + len(close) + len(obs_ids))
    if after + 1 > budget:
        r.end("max_episode_tokens")
        return
    if drops and r.ep.images and any(r.ep.loss_mask):
        r.seal()   # a screenshot the policy's turns saw is about to go: train them with it
    r.add(close, "template", 0)
    r.add(obs_ids, "env", 0)
    r.ep.images.extend(images)
    _drop_oldest_images(r, processor, max_images)


def _kept_length(ids: list[int], n_images: int, processor, max_images: int) -> int:
    """len(ids) once the oldest images past `max_images` are dropped (as _drop_oldest_images will);
    `ids` (a copy) is changed."""
    for _ in range(n_images - max_images):
        lo, hi = oldest_image_span(ids, processor)
        del ids[lo:hi]
    return len(ids)


def _drop_oldest_images(r: _Run, processor, max_images: int) -> None:
    """rollout.max_images_per_episode: remove the oldest images' tokens (never policy tokens) until at
    most `max_images` remain; the segment counts follow."""
    while max_images and len(r.ep.images) > max_images:
        lo, hi = oldest_image_span(r.ep.input_ids, processor)
        del r.ep.input_ids[lo:hi], r.ep.loss_mask[lo:hi]
        r.ep.images.pop(0)
        r.ep.info["images_dropped"] = r.ep.info.get("images_dropped", 0) + 1
        at = 0
        for seg in r.ep.segments:   # the span lies inside one prompt / env segment
            if at <= lo < at + seg[1]:
                seg[1] -= hi - lo
                break
            at += seg[1]


def _finish_cut_short(pool: ThreadPoolExecutor, runs: list[_Run]) -> None:
    """Episodes ended by the runner's limits get the environment's `finish()` reward, if it has one."""
    short = [r for r in runs if not r.ep.failed and not r.ep.done and hasattr(r.env, "finish")]
    for r, (ok, val) in zip(short, _call_all(pool, [r.env.finish for r in short])):
        if ok:
            r.ep.reward += float(val or 0.0)
        else:
            r.fail(val)
