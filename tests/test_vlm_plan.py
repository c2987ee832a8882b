"""The planner on a vision-language model: traced activations (decoder at the sequence length with its
image tokens, vision tower on the images' patches, LM head) against a real CPU step of preset:vlm-tiny
within 5%; frozen vision parts hold no optimizer state; the catalog's Qwen3-VL-8B count is the published one."""

from __future__ import annotations

import gc
import os
import tempfile

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-vlm-plan-test-"))

import pytest
import torch

from test_vlm_helpers import vlm_config, write_dataset
from trainfit import algos
from trainfit.models.lora_rules import module_part
from trainfit.plan.head import HeadSpec, head_memory
from trainfit.models.shapes import arch_facts, locate
from trainfit.plan.trace import TRACE_LAYERS, TraceSpec, trace
from trainfit.plan.tracker import LiveTracker
from trainfit.plan.vision import at, vision_trace

IMAGE = (64, 96)   # (height, width): 6 image tokens, 24 patches on vlm-tiny


def real_saved(batch: int, text: int, tower: bool, projector: bool, ckpt: bool = False) -> tuple[int, int]:
    """(saved-for-backward bytes of a real CPU step of the tiny VLM, tokens a row): rows of `text` text
    tokens with one image each, a padded row, the SFT loss, backward."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from trainfit.config import ModelConfig
    from trainfit.models.policy import load_tokenizer
    from trainfit.models.presets import preset_config
    from trainfit.models.images import load_processor

    torch.manual_seed(0)
    cfg = preset_config("preset:vlm-tiny")
    model = AutoModelForImageTextToText.from_config(cfg, attn_implementation="sdpa").train()
    if ckpt:   # as trainfit.models.policy.enable_checkpointing: every layer, the vision tower's blocks too
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    trained = {"language": True, "tower": tower, "projector": projector}
    for n, p in model.named_parameters():
        p.requires_grad_(trained[module_part(n)])
    mc = ModelConfig(name="preset:vlm-tiny")
    proc = load_processor(mc, load_tokenizer(mc))
    n_img = proc.tokens_for(*IMAGE)
    row = [5, 6, cfg.vision_start_token_id] + [cfg.image_token_id] * n_img + [cfg.vision_end_token_id]
    row += torch.randint(3, 500, (text,)).tolist()
    ids = torch.tensor([row] * batch)
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0   # a padded row: the trainer's batches are padded, so the mask is materialized
    px = proc.pixels([Image.new("RGB", IMAGE[::-1], (200, 20, 20))] * batch)
    inputs = dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == cfg.image_token_id).long(), **px)
    params = {id(p.untyped_storage()) for p in model.parameters()} | {id(b.untyped_storage()) for b in model.buffers()}
    tracker = LiveTracker(params)
    gc.disable()
    try:
        with tracker.mode, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
            logits = model(**inputs).logits
            labels = ids.masked_fill((mask == 0) | (ids == cfg.image_token_id), -100)
            loss, _ = algos.sft_loss(logits, labels)
            del logits
            loss.backward()
    finally:
        gc.enable()
    return tracker.saved_bytes(), ids.shape[1]


def predicted_saved(batch: int, tokens: int, tower: bool, projector: bool, ckpt: bool = False) -> int:
    src = locate("preset:vlm-tiny")
    facts = arch_facts(src)
    mode = "ckpt" if ckpt else "train"
    tr = trace(src, TraceSpec("fp32", "sdpa", device="cpu"), modes=(mode,))
    body = tr.at(f"{mode}_saved", tokens, batch) + (facts.n_layers - TRACE_LAYERS) * tr.at(f"{mode}_saved_layer", tokens, batch)
    head = head_memory(HeadSpec("sft", facts.vocab, facts.hidden, "fp32", batch, tokens, head_trainable=True))
    vis = vision_trace(src, "fp32", tower, projector, ckpt)
    merge = src.config["vision_config"]["spatial_merge_size"]
    from trainfit.models.images import ImageSettings, image_patches
    from trainfit.models.vlm_preset import VLM_PRESETS
    arch = VLM_PRESETS["vlm-tiny"]
    s = ImageSettings(16, merge, 2, arch["min_pixels"], arch["max_pixels"])
    return int(body + head["saved"] + at(vis["saved"], [image_patches(*IMAGE, s)] * batch))


@pytest.mark.parametrize("tower,projector,ckpt", [(False, False, False), (True, True, False), (True, True, True)])
def test_traced_activations_match_a_real_cpu_step(tower, projector, ckpt):
    real, tokens = real_saved(2, 40, tower, projector, ckpt)
    pred = predicted_saved(2, tokens, tower, projector, ckpt)
    assert abs(pred - real) <= 0.05 * real, f"predicted {pred} vs real {real} bytes"
    if tower and not ckpt:   # the trained tower's share is real: leaving it out would miss the 5%
        assert abs(pred - at(vision_trace(locate("preset:vlm-tiny"), "fp32", True, True)["saved"], [24, 24]) - real) \
            > 0.05 * real


def test_plan_counts_image_tokens_and_frozen_parts(tmp_path):
    from trainfit.plan import plan

    data = write_dataset(tmp_path / "data")
    frozen = plan(vlm_config(tmp_path, data), gpu="h100", suggest=False)
    trained = plan(vlm_config(tmp_path, data, **{"model.freeze_vision_tower": "false",
                                                  "model.freeze_projector": "false"}), gpu="h100", suggest=False)
    facts = arch_facts(locate("preset:vlm-tiny"))
    assert trained.trainable_params == facts.n_params
    assert frozen.trainable_params == facts.n_params - facts.n_vision
    # The planned sequence holds the heaviest row's image tokens (12 for its 130 x 90 image).
    assert any("12 image tokens" in n for n in frozen.notes)
    vis = [i for i in frozen.items if i.name.startswith("vision tower activations")]
    assert len(vis) == 1 and vis[0].train > 0


def test_lora_plan_targets_the_language_model_only():
    from trainfit.models.shapes import match_targets

    facts = arch_facts(locate("preset:vlm-tiny"))
    groups = match_targets(facts, "all-linear")
    assert groups and {module_part(g.name) for g in groups} == {"language"}


def test_catalog_qwen3_vl_8b_counts_vision_and_language():
    facts = arch_facts("Qwen/Qwen3-VL-8B-Instruct")
    assert facts.n_params == facts.published_params == 8_767_123_696
    assert facts.tower_sizes and facts.projector_sizes and 0.5e9 < facts.n_vision < 0.7e9


@pytest.mark.parametrize("overrides", [{}, {"peft.method": "lora"},
                                       {"peft.method": "lora", "model.freeze_vision_tower": "false"},
                                       {"model.freeze_projector": "false"}])
def test_planned_trainable_parameters_equal_the_trainers(tmp_path, overrides):
    from trainfit.models.policy import count_parameters, load_policy
    from trainfit.plan import plan

    cfg = vlm_config(tmp_path, write_dataset(tmp_path / "data", n=2), **overrides)
    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"))
    assert plan(cfg, gpu="h100", suggest=False).trainable_params == count_parameters(loaded.model)[1]


def shapes_grpo_config(tmp_path, **overrides):
    """GRPO on the shapes task (prompts carry a 64 x 64 image: 4 image tokens on vlm-tiny), CPU pinned."""
    from trainfit.config import load_config

    base = {"stage": "grpo", "run_dir": str(tmp_path / "run"), "model": {"name": "preset:vlm-tiny"},
            "task": {"name": "shapes", "chat": True, "num_eval": 2},
            "grpo": {"num_generations": 2, "beta": 0.1}, "rollout": {"max_new_tokens": 4},
            "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 2, "lr": 1e-3, "device": "cpu"},
            "logging": {"tensorboard": False, "progress": False, "plot": False}}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()], base=base)


def test_grpo_image_prompts_planned_at_the_trainers_length(tmp_path):
    """The plan's prompt length for an image task is the longest prompt the GRPO stage really hands its
    engine in a run (image tokens expanded), and every training forward fits the planned sequence."""
    from rich.console import Console

    from trainfit.models.policy import unwrap
    from trainfit.plan import plan
    from trainfit.train.faults import Faults
    from trainfit.train.loop import train_stage
    from trainfit.train.run import build_stage

    cfg = shapes_grpo_config(tmp_path)
    p = plan(cfg, gpu="h100", suggest=False)
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    image_id = loaded.processor.image_token_id
    prompts: list[list[int]] = []   # the prompts of the run's rollouts (not the greedy eval's)
    generate = stage.engine.generate

    def spy_generate(batch, **kw):
        if kw.get("images") and kw.get("seeds") is not None:
            prompts.extend(list(r) for r in batch)
        return generate(batch, **kw)

    widths: list[int] = []          # training forwards (grad on): tokens a row

    def spy_forward(module, args, kwargs):
        if torch.is_grad_enabled() and kwargs.get("input_ids") is not None:
            widths.append(kwargs["input_ids"].shape[1])

    stage.engine.generate = spy_generate
    handle = unwrap(loaded.model, peft=True).register_forward_pre_hook(spy_forward, with_kwargs=True)
    try:
        train_stage(cfg, loaded, stage, tmp_path / "stage", resume=False, console=Console(file=open(os.devnull, "w")),
                    faults=Faults(), save_final=lambda path, state_dict=None: path)
    finally:
        handle.remove()
    # The planner measured the run's whole prompt population (2 steps x 2 prompts x 2 generations).
    assert len(prompts) == 8 and all(r.count(image_id) == 4 for r in prompts)
    assert p.prompt_len == max(map(len, prompts))
    assert p.seq_len == p.prompt_len + cfg.rollout.max_new_tokens
    assert widths and max(widths) <= p.seq_len
    # The training forwards run the task's images through the (frozen) tower: planned from the task.
    assert any(i.name.startswith("vision tower activations (1 image(s) a sequence, 4 image tokens)") for i in p.items)


def test_image_task_prompts_count_image_tokens_not_the_placeholder(tmp_path):
    """The measured prompt equals the trainer's encoding of each example's prompt, which differs from
    the text-with-placeholder encoding by the image's tokens (so counting it as text would be wrong)."""
    from trainfit.data.text import encode_prompt
    from trainfit.models.policy import load_tokenizer
    from trainfit.plan.lengths import data_lengths
    from trainfit.tasks import build_task
    from trainfit.models.images import load_processor
    from trainfit.data.image_examples import encode_image_prompt

    cfg = shapes_grpo_config(tmp_path, **{"train.max_steps": 5})
    tok = load_tokenizer(cfg.model)
    proc = load_processor(cfg.model, tok)
    task = build_task(cfg.task)
    n = 5 * cfg.batch_plan().prompts_per_step
    exs = [task.train_example(i) for i in range(n)]
    real = [len(encode_image_prompt(tok, proc, ex, True)) for ex in exs]
    text = [len(encode_prompt(tok, ex, True)) for ex in exs]
    lens = data_lengths(cfg)
    assert lens.from_data and lens.rows == n
    assert lens.prompt == max(real) and lens.mean == pytest.approx(sum(real) / n)
    assert max(text) != max(real)


def test_qwen3_vl_8b_sft_4gpu_example_is_planned():
    """examples/qwen3_vl_8b_sft_4gpu.yaml: 4 FSDP ranks shard the states, the frozen tower and projector
    hold no optimizer state, the data's screenshots are counted at the example's max_pixels, and a
    1280 x 800 screenshot is 1,000 image tokens under those settings."""
    from pathlib import Path

    from PIL import Image

    from trainfit.config import load_config
    from trainfit.plan import plan
    from trainfit.models.images import image_tokens
    from trainfit.plan.vision import image_settings

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples" / "qwen3_vl_8b_sft_4gpu.yaml")
    assert cfg.distributed.num_gpus == 4 and cfg.engine() == "fsdp"
    src = locate(cfg.model.name)
    s = image_settings(cfg.model, src)
    assert image_tokens(800, 1280, s) == 1000 and image_tokens(1080, 1920, s) <= 1024
    p = plan(cfg, suggest=False)
    facts = arch_facts(src)
    assert p.num_gpus == 4 and p.fits and p.trainable_params == facts.n_params - facts.n_vision
    shots = [Image.open(f).size for f in sorted((root / "examples" / "data" / "screens").glob("*.png"))]
    assert len(shots) >= 2
    heaviest = max(image_tokens(h, w, s) for w, h in shots)
    vis = [i for i in p.items if i.name.startswith("vision tower activations")]
    assert len(vis) == 1 and f", {heaviest} image tokens)" in vis[0].name
    one = plan(cfg, num_gpus=1, suggest=False)
    opt = {q.name: q.train for q in p.items}["policy optimizer state"]
    assert opt == pytest.approx({q.name: q.train for q in one.items}["policy optimizer state"] / 4, rel=0.01)


def test_image_task_sft_items_planned_at_the_trainers_length(tmp_path):
    """SFT on the shapes task: the measured item length is the trainer's item (train/sft.py encodes an
    image example with data/image_examples.encode_image_example), image tokens expanded."""
    from trainfit.models.policy import load_tokenizer
    from trainfit.plan.lengths import data_lengths
    from trainfit.tasks import build_task
    from trainfit.models.images import load_processor
    from trainfit.data.image_examples import encode_image_example

    cfg = shapes_grpo_config(tmp_path, stage="sft", **{"data.max_seq_length": 64})
    tok = load_tokenizer(cfg.model)
    proc = load_processor(cfg.model, tok)
    task = build_task(cfg.task)
    n = cfg.train.max_steps * cfg.batch_plan().global_batch
    real = [len(encode_image_example(tok, proc, task.train_example(i), 64, True)["input_ids"]) for i in range(n)]
    lens = data_lengths(cfg)
    assert lens.from_data and lens.rows == n and lens.seq == max(real)
