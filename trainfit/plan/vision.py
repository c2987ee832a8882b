"""The planner's vision figures: image settings, images per sequence, and the vision tower's
activations traced like the decoder's (plan/trace.py).

The vision tower of the Qwen-VL family runs on the patches of every image of a micro-batch, packed
into one sequence [patches, C x temporal x patch^2]; its attention is per image (cu_seqlens). One
image per traced forward at three grid sizes (patches p = 16, 32, 64 x merge^2 / 4) under
FakeTensorMode on the real architecture (full depth: the language model is cut to one layer, which
the vision tower does not use) gives, fitted exactly by a quadratic in p:
  vision_end    bytes live at the end of the tower's forward: what autograd saved for backward in
                the trained parts (none when tower and projector are frozen) and the outputs (merged
                image embeddings [p / merge^2, hidden] and each DeepStack feature of that size),
                which the model keeps until its forward returns;
  vision_saved  saved-for-backward bytes alone (the CPU test compares them with a real step);
  vision_peak   peak live bytes during the tower's forward (before the decoder runs).
The image tokens inside the decoder are ordinary tokens of the sequence: the decoder's trace at the
sequence length (image tokens counted) covers them.
"""

from __future__ import annotations

import copy
import gc
import json
from pathlib import Path
from typing import Optional

from trainfit.config.stages import stage_spec
from trainfit.core import cache
from trainfit.data.image_chat import build_vlm_items, flatten_messages, has_images, mark_base_dirs
from trainfit.data.image_examples import encode_image_example, encode_image_prompt, example_images
from trainfit.data.text import encode_example, encode_prompt, load_records
from trainfit.models.catalog import catalog_entries, catalog_lookup
from trainfit.models.images import ImageSettings, VisionProcessor, image_patches, image_size, image_tokens
from trainfit.models.lora_rules import module_part
from trainfit.models.shapes import hf_config, instantiate, model_source
from trainfit.models.vlm_preset import VLM_PRESETS
from trainfit.plan.sample import population_size, sample_indices
from trainfit.plan.trace import DTYPES, enable_checkpointing, fit_quadratic, trace_config
from trainfit.plan.tracker import LiveTracker, fake_copy
from trainfit.tasks import build_task

GRIDS = ((4, 4), (4, 8), (8, 8))   # traced image grids in merge units x 2 (h, w patches = 2 x merge x ...)
# Qwen-VL pixel limits when a source has no processor config (Qwen2/2.5-VL's defaults, in pixels).
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 56 * 56, 28 * 28 * 1280


def image_settings(mc, src) -> ImageSettings:
    """The processor settings a run uses: the preset's, a local dir's preprocessor_config.json, a
    catalog entry's `image_processor`, else the vision config's patch numbers with Qwen's default
    pixel limits; model.min_pixels / max_pixels override the limits."""
    vc = src.config.get("vision_config") or {}
    proc: dict = {}
    key = src.name.split(":", 1)[1] if src.kind == "preset" else None
    if key in VLM_PRESETS:
        arch = VLM_PRESETS[key]
        proc = {"min_pixels": arch["min_pixels"], "max_pixels": arch["max_pixels"]}
    elif src.kind == "local" and (Path(src.name) / "preprocessor_config.json").is_file():
        proc = json.loads((Path(src.name) / "preprocessor_config.json").read_text())
    elif src.kind == "catalog":
        proc = catalog_entries()[catalog_lookup(src.name)].get("image_processor", {})
    size = proc.get("size") or {}
    lo = mc.min_pixels or size.get("shortest_edge") or proc.get("min_pixels") or DEFAULT_MIN_PIXELS
    hi = mc.max_pixels or size.get("longest_edge") or proc.get("max_pixels") or DEFAULT_MAX_PIXELS
    return ImageSettings(int(proc.get("patch_size") or vc.get("patch_size", 14)),
                         int(proc.get("merge_size") or vc.get("spatial_merge_size", 2)),
                         int(proc.get("temporal_patch_size") or vc.get("temporal_patch_size", 2)), int(lo), int(hi))


def rows_images(cfg, s: ImageSettings) -> tuple[list[int], str]:
    """Patches per image of the data row with the most image patches, and a note. From the task's
    examples (a task: tasks/shapes.py draws its images) or the data's image headers when data.path
    holds rows with images; else one image at model.max_pixels (its tokens capped by the sequence
    length)."""
    d = cfg.data
    if cfg.task.name and not stage_spec(cfg.stage).eval_episodes(cfg):   # else the task only names eval episodes
        try:
            return _task_images(cfg, s)
        except Exception as e:  # the task cannot be built here: plan the assumption below, and say so
            why = f" (the task's images could not be read: {type(e).__name__})"
    elif stage_spec(cfg.stage).data in ("text", "sft") and d.path:
        try:
            return _data_images(d.path, s)
        except Exception as e:  # unreadable data: plan the assumption below, and say so
            why = f" (the data's images could not be read: {type(e).__name__})"
        else:
            why = ""
    else:
        why = ""
    side = int(s.max_pixels ** 0.5)
    tokens = min(image_tokens(side, side, s), max(1, cfg.data.max_seq_length - 16))
    return [tokens * s.merge_size ** 2], (f"Vision: planned one {side} x {side} image a sequence (model.max_pixels"
                                          f" {s.max_pixels}: {tokens} image tokens){why}.")


_TASK_MEMO: dict[str, tuple[list[int], str]] = {}   # plan() runs many times in fit's loops


def _task_images(cfg, s: ImageSettings) -> tuple[list[int], str]:
    """Patches per image of the heaviest example among those lengths.py measures ([] for a task
    whose examples carry no images)."""
    task = build_task(cfg.task)
    n = task.num_train or population_size(cfg)
    key = cache.stable_hash({"task": cfg.task.model_dump(), "n": n, "settings": repr(s)})
    if key not in _TASK_MEMO:
        best: list[int] = []
        for i in sample_indices(n)[0]:
            patches = [image_patches(im.height, im.width, s) for im in example_images(task.train_example(i))]
            if sum(patches) > sum(best):
                best = patches
        _TASK_MEMO[key] = (best, f"Vision: the task's heaviest prompt has {len(best)} image(s), "
                                 f"{sum(best) // s.merge_size ** 2} image tokens." if best
                           else "Vision: the task's prompts hold no images.")
    return _TASK_MEMO[key]


def _data_images(path: str, s: ImageSettings) -> tuple[list[int], str]:
    records = [r for r in mark_base_dirs(load_records(path), path) if has_images(r)]
    if not records:
        return [], "Vision: the data holds no images."

    proc = VisionProcessor(None, None)   # flatten_messages needs only its placeholder text
    best: list[int] = []
    for i, r in enumerate(records[:2048]):
        if isinstance(r.get("messages"), list):
            paths = flatten_messages(r, proc, f"record {i}")[1]
        else:
            listed = r.get("images") or [r.get("image")]
            paths = [Path(r.get("_base_dir", ".")) / p for p in ([listed] if isinstance(listed, str) else listed)]
        patches = [image_patches(*image_size(p), s) for p in paths]
        if sum(patches) > sum(best):
            best = patches
    return best, (f"Vision: the data's heaviest row has {len(best)} image(s), "
                  f"{sum(best) // s.merge_size ** 2} image tokens.")


def vlm_item_lengths(cfg, tok, records: list[dict]) -> list[int]:
    """Token lengths of data rows with images as the trainer builds them (image tokens counted), for
    plan/lengths.py; the image settings come from image_settings (no processor is loaded)."""
    proc = counting_processor(cfg, tok)
    items, _ = build_vlm_items(records, tok, proc, cfg.data.max_seq_length, cfg.stage, cfg.data.text_field)
    return [len(it["input_ids"]) for it in items]


def counting_processor(cfg, tok):
    """A VisionProcessor that counts image tokens from the settings alone (no image processor loaded),
    with the vision tokens images.load_processor takes from the same tokenizer."""
    return VisionProcessor(None, tok, image_token=getattr(tok, "image_token", None) or "<|image_pad|>",
                           start_token=getattr(tok, "vision_start_token", None) or "<|vision_start|>",
                           end_token=getattr(tok, "vision_end_token", None) or "<|vision_end|>",
                           fixed=image_settings(cfg.model, model_source(cfg.model)))


def task_prompt_lengths(cfg, tok, examples: list, rl: bool) -> list[int]:
    """Token lengths of a task's examples as the trainer encodes them, image tokens expanded
    (data/image_examples.py): RL prompts (train/rollout_batch.sample_and_score: prompts with images are
    never cut), or SFT items (train/sft.py, cut after the last image, to data.max_seq_length).
    Text examples of the same task go through data.encode_prompt / encode_example as the trainer's."""
    proc = counting_processor(cfg, tok)
    chat, limit = cfg.task.chat, cfg.rollout.max_prompt_length
    out = []
    for ex in examples:
        if rl:
            out.append(len(encode_image_prompt(tok, proc, ex, chat) if example_images(ex)
                           else encode_prompt(tok, ex, chat)[-limit:]))
        elif example_images(ex):
            out.append(len(encode_image_example(tok, proc, ex, cfg.data.max_seq_length, chat)["input_ids"]))
        else:
            out.append(len(encode_example(tok, ex, cfg.data.max_seq_length, chat)["input_ids"]))
    return out


def vision_trace(src, dtype: str, tower: bool, projector: bool, ckpt: bool = False) -> dict[str, list[float]]:
    """Fitted vision figures (quadratic in patches of one image, bytes), cached on disk. `ckpt`: the
    tower's blocks checkpointed (the trainer's model-wide switch, models.enable_checkpointing,
    reaches them whenever any decoder layer is checkpointed)."""
    key = cache.stable_hash({"arch": src.key(), "dtype": dtype, "tower": tower, "projector": projector,
                             "grids": GRIDS, "kind": "vision", "ckpt": ckpt})
    found = cache.read("traces", key)
    if found is None:
        rows = _trace_points(src, dtype, tower, projector, ckpt)

        xs = [r["patches"] for r in rows]
        found = {"coef": {q: fit_quadratic(xs, [r[q] for r in rows]) for q in ("end", "saved", "peak")}}
        cache.write("traces", key, found)
    return found["coef"]


def _trace_points(src, dtype: str, tower: bool, projector: bool, ckpt: bool) -> list[dict]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import vision_utils as vu


    cfg = trace_config(hf_config(src), 1)
    with torch.device("meta"):
        model = instantiate(cfg, getattr(torch, DTYPES[dtype]), attn_implementation="sdpa")
    if ckpt:
        enable_checkpointing(model)
    model.train()
    visual = model.model.visual
    trained = {"tower": tower, "projector": projector, "language": False}
    for name, p in visual.named_parameters(prefix="model.visual"):
        p.requires_grad_(trained[module_part(name)])
    fm = FakeTensorMode(allow_non_fake_inputs=True)
    fake_copy([visual], fm)
    vc, merge = cfg.vision_config, cfg.vision_config.spatial_merge_size
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    rows = []
    for gh, gw in GRIDS:
        grid = torch.tensor([[1, gh * merge // 2, gw * merge // 2]])
        kw = _precomputed(visual, grid, vc, fm, vu)
        n = int(grid.prod())
        params = list(visual.parameters())
        exclude = {id(p.untyped_storage()) for p in params} | {id(b.untyped_storage()) for b in visual.buffers()}
        tracker = LiveTracker(exclude)
        gc.disable()
        try:
            with fm, tracker.mode, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
                px = torch.empty(n, width, dtype=getattr(torch, DTYPES[dtype]))
                out = visual(px, grid_thw=grid, **kw)
                tracker.mark("forward")
                peak = tracker.peak()
                keep = [out.pooler_output, *out.deepstack_features]
                del out
        finally:
            gc.enable()
        end = sum(tracker.live_at(tracker.marks["forward"]).values())
        rows.append({"patches": n, "end": end, "saved": tracker.saved_bytes(), "peak": peak})
        del keep
        for p in params:
            p.grad = None
    return rows


def _precomputed(visual, grid, vc, fm, vu) -> dict:
    """The tower's grid-derived index tensors computed on real tensors (they read grid values, which
    fake tensors do not hold), cu_seqlens as a constant fake tensor (the SDPA path splits by it)."""
    ii, iw = vu.get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=vc.spatial_merge_size)
    cu, mx = vu.get_vision_attention_seqlens(grid, vc)
    return {"interp_indices": ii, "interp_weights": iw, "max_seqlen": mx,
            "position_ids": vu.get_vision_position_ids(grid, visual.spatial_merge_size),
            "cu_seqlens": fm.fake_tensor_converter.from_real_tensor(fm, cu, make_constant=True)}


def at(coef: list[float], patches: list[int]) -> float:
    """A fitted figure for one sequence's images: the per-image terms summed, the constant once."""
    if not patches:
        return 0.0
    c0, c1, c2 = coef
    return max(0.0, c0 + sum(c1 * p + c2 * p * p for p in patches))


def vision_memory(cfg, src, mb: int, images: Optional[tuple[list[int], str]] = None) -> Optional[dict]:
    """{"end", "saved", "peak", "patches", "note"} of a micro-batch's images (bytes), or None for a
    model without a vision tower or a run without images. `images`: (patches per image of one
    sequence, note) given by the caller (an episode's screenshots, plan/screens.py), else rows_images."""
    if not (src.config.get("vision_config") and "qwen" in src.config.get("model_type", "")):
        return None
    m = cfg.model
    s = image_settings(m, src)
    patches, note = images if images is not None else rows_images(cfg, s)
    if not patches:
        return None
    # A trained part (full, or LoRA on it) saves activations for backward; a frozen one saves none.
    coef = vision_trace(src, m.dtype, not m.freeze_vision_tower, not m.freeze_projector,
                        ckpt=bool(m.gradient_checkpointing))
    # The micro-batch's images run as one packed sequence: the per-image terms add, the constant once.
    return {q: int(at(coef[q], patches * mb)) for q in ("end", "saved", "peak")} | {
        "patches": patches, "note": note, "settings": copy.copy(s)}
