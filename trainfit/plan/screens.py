"""The planner's environment screenshots: how many an episode keeps, the image tokens each costs, and
whether they fit the episode's token budget.

An RL stage with an environment (env.type != none) on a vision-language policy sees the screen the
environment answers with (data/image_parts.py). An episode holds the reset's screenshot and one
per observation after a policy turn; the last turn's observation is never appended (envs/episodes.py),
so at most max_turns screenshots, and rollout.max_images_per_episode keeps the newest of them:
kept = min(max_images_per_episode or max_turns, max_turns), one screenshot per observation assumed.

Each is planned as the heaviest screen model.max_pixels allows (heaviest_screen): the processor keeps
an image whose sides are whole tokens (multiples of factor) and whose pixels are within max_pixels as
it is (models/images.resized, smart_resize), so the most tokens any screen takes is the largest a x b
with a x b x factor^2 <= max_pixels (aspect ratio at most 200). That is not always the square of side
isqrt(max_pixels): at max_pixels 35840 a MiniWoB 160 x 210 screenshot takes 35 tokens (224 x 160),
the 189 x 189 square only 25. The image
tokens are ordinary tokens of the decoder's sequence (rollout.max_episode_tokens, traced with the
episode); the vision tower's activations for the kept screenshots are added to the training forward
(vision/plan.vision_memory with these patches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from trainfit.config.stages import stage_spec
from trainfit.models.images import ImageSettings, image_patches, image_tokens
from trainfit.plan.rollout import VLLM_PROFILE_TOKENS
from trainfit.plan.states import DTYPE_BYTES
from trainfit.plan.vision import image_settings, vision_memory


@dataclass(frozen=True)
class Screens:
    kept: int          # screenshots in one episode's context at most
    size: tuple[int, int]   # (height, width) of the planned screen in pixels, as the processor keeps it
    tokens: int        # image tokens of one screenshot (pads; the start / end markers are 2 more)
    patches: int       # vision-tower patches of one screenshot (tokens x merge^2)
    desktop: int       # tokens of a 16:9 screen of the same pixel budget, for the note

    @property
    def sequence_tokens(self) -> int:
        """Tokens the kept screenshots take in the episode (pads + the start and end markers)."""
        return self.kept * (self.tokens + 2)


def plans_screens(cfg, facts) -> bool:
    """Whether an RL stage's environment answers a vision policy with screenshots to plan."""
    return stage_spec(cfg.stage).rollout and cfg.env.type != "none" and bool(facts.n_vision)


def kept_screens(r) -> int:
    """Screenshots one episode keeps in its context at most (see the module docstring)."""
    return min(r.max_images_per_episode or r.max_turns, r.max_turns)


def rows_per_episode(cfg, facts) -> int:
    """Training rows one episode becomes at most (envs/episodes.py, Episode.rows): each screenshot the
    budget drops seals the turns before it as a row, so max_turns - kept + 1 when screenshots drop
    (every turn used), else 1. Each row is a forward and backward of up to the planned row length."""
    if not plans_screens(cfg, facts):
        return 1
    r = cfg.rollout
    return r.max_turns - kept_screens(r) + 1


def heaviest_screen(s: ImageSettings) -> tuple[int, int]:
    """(height, width) in pixels of the screenshot with the most image tokens the settings allow: a x b
    tokens, the largest product with a x b x factor^2 <= max_pixels and b <= 200 a, the squarest of
    those (a <= b: a square when max_pixels is one of whole tokens, as 1440 x 1440 or 256 x 256)."""
    f = s.factor
    n = max(1, s.max_pixels // f ** 2)
    a, b = max(((a, min(n // a, 200 * a)) for a in range(1, math.isqrt(n) + 1)), key=lambda g: (g[0] * g[1], g[0]))
    return a * f, b * f


def screen_tokens(s: ImageSettings) -> tuple[tuple[int, int], int]:
    """((height, width), image tokens) of the heaviest screenshot the settings allow (heaviest_screen),
    counted by the processor's own arithmetic."""
    h, w = heaviest_screen(s)
    return (h, w), image_tokens(h, w, s)


def episode_screens(cfg, s: ImageSettings) -> Screens:
    (h, w), tokens = screen_tokens(s)
    dw = math.isqrt(s.max_pixels * 16 // 9)
    return Screens(kept_screens(cfg.rollout), (h, w), tokens, image_patches(h, w, s),
                   image_tokens(max(1, dw * 9 // 16), dw, s))


def screens_dict(sc: Screens) -> dict:
    """The plan's JSON `lengths.screens`."""
    return {"kept": sc.kept, "image_tokens_per_screenshot": sc.tokens, "patches_per_screenshot": sc.patches,
            "screen_size": list(sc.size), "episode_image_tokens": sc.sequence_tokens}


def screens_note(sc: Screens, s: ImageSettings) -> str:
    h, w = sc.size
    dw = math.isqrt(s.max_pixels * 16 // 9)
    return (f"Screenshots: {sc.kept} kept an episode (rollout.max_images_per_episode, at most max_turns) x "
            f"{sc.tokens} image tokens per screenshot (the heaviest screen at model.max_pixels {s.max_pixels}: "
            f"{w} x {h} after resizing, {s.factor} x {s.factor} pixels a token; a {dw} x {dw * 9 // 16} screen "
            f"takes {sc.desktop}) = {sc.sequence_tokens} tokens of the episode with their markers; the vision "
            "tower runs on them in every training forward.")


def budget_problem(cfg, sc: Screens, s: ImageSettings) -> Optional[str]:
    """A plan problem when the kept screenshots alone exceed rollout.max_episode_tokens (an episode
    then ends at the token budget before it holds them: an observation that does not fit ends it,
    envs/episodes._append_observation), naming changes `train` accepts."""
    r = cfg.rollout
    budget = cfg.episode_tokens()
    if sc.sequence_tokens <= budget:
        return None
    room = budget - r.max_turns * r.max_new_tokens   # what the policy's turns leave for screens
    fixes = []
    n = room // (sc.tokens + 2) if room > 0 else 0
    if n >= 1:
        fixes.append(f"rollout.max_images_per_episode={n}")
    px = fitting_pixels(s, room // max(1, sc.kept) - 2) if room > 0 else None
    if px:
        fixes.append(f"model.max_pixels={px}")
    fixes.append(f"rollout.max_episode_tokens={sc.sequence_tokens + r.max_turns * r.max_new_tokens} "
                 "(a longer training sequence: more memory)")
    return (f"{sc.kept} kept screenshots x {sc.tokens + 2} tokens ({sc.tokens} image tokens per screenshot + 2 "
            f"markers) = {sc.sequence_tokens} tokens exceed "
            f"rollout.max_episode_tokens={budget}: episodes end at the token budget before they hold their "
            f"screenshots; set " + " or ".join(fixes) + ".")


def fitting_pixels(s: ImageSettings, tokens: int) -> Optional[int]:
    """The largest max_pixels (a multiple of factor^2, at least min_pixels) whose heaviest screenshot
    takes at most `tokens` image tokens, or None."""
    px = tokens * s.factor ** 2
    while px >= max(s.min_pixels, s.factor ** 2):
        if screen_tokens(ImageSettings(s.patch_size, s.merge_size, s.temporal_patch_size,
                                       min(s.min_pixels, px), px))[1] <= tokens:
            return px
        px -= s.factor ** 2
    return None


def rollout_screens(Item, items: list, cfg, src, facts, sc: Screens, bp, notes: list, problems: list) -> None:
    """The budget problem, and the rollout engine's share for the screenshots: HF generate runs the
    tower on the kept screenshots of every episode it generates at each turn's prefill (an item);
    vLLM holds them inside its envelope (a note)."""
    problems += [p for p in [budget_problem(cfg, sc, image_settings(cfg.model, src))] if p]
    if cfg.rollout.engine == "vllm":
        notes.append(vllm_screens_note(sc, facts, cfg.model.dtype))
    elif cfg.rollout.engine == "hf":
        gen = min(cfg.rollout.batch_size or bp.per_device_batch, bp.per_device_batch)
        gv = vision_memory(cfg, src, gen, ([sc.patches] * sc.kept, ""))
        items.append(Item(f"vision tower forward ({gen} episodes x {sc.kept} screenshots)", "rollout",
                          rollout=gv["peak"], note="traced peak of the tower's forward, at each turn's prefill"))


def vllm_screens_note(sc: Screens, facts, dtype: str) -> str:
    """vLLM's multimodal share, as a note: the image tokens of one request and its encoder cache (the
    vision tower's outputs kept for the scheduled requests: max(max_num_batched_tokens, one image's
    tokens) embeddings of the decoder's width), which vLLM holds inside its gpu_memory_utilization
    envelope; not subtracted from the KV cache figure above, and the tower's own profiling forward on
    a largest image is not planned."""
    cache = max(VLLM_PROFILE_TOKENS, sc.tokens) * facts.hidden * DTYPE_BYTES[dtype]
    return (f"vLLM multimodal: a request holds up to {sc.kept} screenshots = {sc.kept * sc.tokens} image tokens; "
            f"its encoder cache of max({VLLM_PROFILE_TOKENS}, {sc.tokens}) image embeddings takes about "
            f"{cache / 2**20:.0f} MiB (more with DeepStack features) inside the engine's share, not subtracted "
            "from the KV cache above; the vision encoder's profiling run is not planned.")
