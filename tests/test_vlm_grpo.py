"""GRPO with images on preset:vlm-tiny: the shapes task (prompts carry Pillow-drawn images), generation
through the hf engine's VLM path, and the image inputs reaching the trainer's forwards."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from rich.console import Console

from trainfit.config import load_config
from trainfit.models.policy import unwrap
from trainfit.tasks import build_task
from trainfit.tasks.shapes import COLOURS, ShapesTask, first_colour
from trainfit.train.faults import Faults
from trainfit.train.loop import train_stage
from trainfit.train.report import read_metrics
from trainfit.train.run import build_stage

QUIET = Console(file=open("/dev/null", "w"))
# Rewards that differ within a group from the first step (a random-init policy rarely names a colour).
REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"


def grpo_config(tmp_path, **overrides):
    base = {"stage": "grpo", "run_dir": str(tmp_path / "run"), "model": {"name": "preset:vlm-tiny"},
            "task": {"name": "shapes", "chat": True, "num_eval": 4},
            "grpo": {"num_generations": 2, "beta": 0.1},
            "rollout": {"max_new_tokens": 4},
            "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 2, "lr": 1e-3, "device": "cpu"},
            "logging": {"tensorboard": False, "progress": False, "plot": False}}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()], base=base)


def test_shapes_task_holds_out_its_eval_images():
    task = ShapesTask(seed=3, num_eval=16, chat=True)
    held = {tuple(map(tuple, ex.fields["layout"])) for ex in task.eval_examples()}
    assert len(held) == 16
    train = [task.train_example(i) for i in range(300)]
    assert not {tuple(map(tuple, ex.fields["layout"])) for ex in train} & held
    ex = train[0]
    assert len(ex.images) == 1 and ex.images[0].size == (64, 64) and ex.answer in COLOURS
    assert "<image>" in ex.messages[0]["content"] and ex.fields["shape"] in ex.messages[0]["content"]
    # The asked shape's colour is drawn in the image (the answer is recoverable from the pixels).
    assert COLOURS[ex.answer] in {c for _, c in ex.images[0].getcolors(4096)}
    assert task.is_correct(f"It is {ex.answer}.", ex) and first_colour("no colour") is None


def test_shapes_task_is_built_by_name(tmp_path):
    assert isinstance(build_task(grpo_config(tmp_path).task), ShapesTask)


def test_grpo_two_steps_with_image_prompts(tmp_path):
    cfg = grpo_config(tmp_path, **{"task.rewards": f"[{REWARD}]", "train.lr": 1e-2})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    model = unwrap(loaded.model, peft=True)
    seen: list[dict] = []   # what each forward received

    def spy(module, args, kwargs):
        # generate may encode the images first and hand the prefill their features (mm_encoder_outputs)
        images = kwargs.get("pixel_values") is not None or kwargs.get("mm_encoder_outputs") is not None
        seen.append({"pixels": images, "ids": kwargs.get("input_ids"),
                     "grid": kwargs.get("image_grid_thw"), "grad": torch.is_grad_enabled()})

    handle = model.register_forward_pre_hook(spy, with_kwargs=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        train_stage(cfg, loaded, stage, tmp_path / "stage", resume=False, console=QUIET, faults=Faults(),
                    save_final=lambda path, state_dict=None: path)
    finally:
        handle.remove()
    metrics = [m for m in read_metrics(tmp_path / "stage" / "metrics.jsonl") if "loss" in m]
    assert len(metrics) == 2 and all(math.isfinite(m["loss"]) for m in metrics)
    # Every full-sequence forward (generation prefill, reference, training; decode steps see one
    # token) got the images, and each of its rows holds its image's 4 tokens (64 x 64 on vlm-tiny).
    image_id = loaded.processor.image_token_id
    full = [s for s in seen if s["ids"] is not None and s["ids"].shape[1] > 1]
    assert all(s["pixels"] for s in full)
    assert any(s["grad"] for s in full) and sum(not s["grad"] for s in full) >= 2   # training + generate / ref
    for s in full:
        assert ((s["ids"] == image_id).sum(1) == 4).all()
        if s["grad"]:   # training forwards: one image per row
            assert s["grid"].shape[0] == s["ids"].shape[0]
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed and all("visual" not in n for n in changed)   # the tower is frozen by default


def test_policy_tokens_only_carry_loss(tmp_path):
    from trainfit.train.rollout_batch import sample_and_score

    cfg = grpo_config(tmp_path)
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    ex = stage.task.train_example(0)
    samples, texts, total, _, _ = sample_and_score(stage.engine, loaded.tokenizer, cfg, [ex, ex], [1, 2],
                                                   stage.reward_fns, stage.reward_weights, vision=stage.vision)
    image_id = loaded.processor.image_token_id
    for s in samples:
        ids, mask = s["input_ids"], s["loss_mask"]
        assert s["images"] == ex.images and ids.count(image_id) == 4
        assert all(m == 0 for t, m in zip(ids, mask) if t == image_id)
        n_prompt = mask.index(1) if 1 in mask else len(mask)
        assert set(mask[:n_prompt]) <= {0} and set(mask[n_prompt:]) <= {1}
    assert total.shape == (2,)


def test_engine_and_trainer_agree_on_image_prompts(tmp_path):
    """The hf engine's log-probs of its own samples (generate, left-padded, with the images) equal the
    trainer's (right-padded forward with image inputs): the same images and 3-D positions reach both,
    and a different image changes them (the images are really read)."""
    from trainfit.models.logprobs import sequence_logprobs, single_turn_sample
    from trainfit.data.image_examples import encode_image_prompt, image_inputs

    cfg = grpo_config(tmp_path, **{"rollout.max_new_tokens": 6, "rollout.temperature": 1.0})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    task, proc, tok = stage.task, stage.vision, loaded.tokenizer
    exs = [task.train_example(i) for i in range(3)]
    prompts = [encode_image_prompt(tok, proc, ex, True) for ex in exs]
    outs = stage.engine.generate(prompts, seeds=[5, 6, 7], logprobs=True, images=[ex.images for ex in exs])
    samples = [dict(single_turn_sample(p, o.token_ids), images=ex.images) for p, o, ex in zip(prompts, outs, exs)]
    with torch.no_grad():
        logp, mask, _ = sequence_logprobs(loaded.model, samples, tok.pad_token_id, "cpu",
                                          inputs=image_inputs(samples, proc, "cpu"))
        for row, m, o in zip(logp, mask, outs):
            assert torch.allclose(row[m], torch.tensor(o.logprobs), atol=1e-4)
        other = [dict(s, images=[exs[(i + 1) % 3].images[0]]) for i, s in enumerate(samples)]
        logp2, _, _ = sequence_logprobs(loaded.model, other, tok.pad_token_id, "cpu",
                                        inputs=image_inputs(other, proc, "cpu"))
    assert not torch.allclose(logp[mask], logp2[mask])


def test_openai_engine_sends_images_to_trainfit_serve(tmp_path):
    """Image prompts through the openai engine (image_url content parts, verbatim chat template) and
    `trainfit serve` (image parts for a VLM): the same tokens and log-probs as the in-process hf engine
    sampling with the same seeds from the same weights."""
    from serve_helpers import serve_subprocess
    from trainfit.config import ModelConfig, PeftConfig, RolloutConfig
    from trainfit.models.policy import load_policy
    from trainfit.models.save import save_pretrained
    from trainfit.rollout.hf import HFEngine
    from trainfit.rollout.openai_engine import OpenAIEngine
    from trainfit.data.image_examples import encode_image_prompt

    save_pretrained(load_policy(ModelConfig(name="preset:vlm-tiny"), PeftConfig(), torch.device("cpu")), tmp_path / "m")
    local = load_policy(ModelConfig(name=str(tmp_path / "m")), PeftConfig(), torch.device("cpu"))
    task = ShapesTask(seed=1, num_eval=2, chat=True)
    exs = [task.train_example(i) for i in range(2)]
    prompts = [encode_image_prompt(local.tokenizer, local.processor, ex, True) for ex in exs]
    images = [ex.images for ex in exs]
    hf = HFEngine(local.model, local.tokenizer, RolloutConfig(max_new_tokens=5))
    hf.processor = local.processor
    want = hf.generate(prompts, seeds=[3, 4], logprobs=True, images=images)
    with serve_subprocess(tmp_path / "m", tmp_path / "server.log") as (url, _):
        eng = OpenAIEngine(RolloutConfig(engine="openai", base_url=url, max_new_tokens=5, health_timeout_s=120),
                           local.tokenizer, workdir=tmp_path)
        try:
            got = eng.generate(prompts, seeds=[3, 4], logprobs=True, images=images)
        finally:
            eng.close()
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)


def test_rollout_buffer_with_images_survives_a_weights_only_checkpoint(tmp_path):
    from trainfit.train.checkpoint import safe_load
    from trainfit.train.stage import StepBatch
    from trainfit.data.image_examples import buffer_images

    ims = [ShapesTask(seed=0, num_eval=1).train_example(i).images[0] for i in range(2)]
    buf = StepBatch(samples=[{"input_ids": [1, 2], "loss_mask": [0, 1], "images": [ims[0]]},
                             {"input_ids": [3], "loss_mask": [1]}, {"input_ids": [4], "loss_mask": [1], "images": [ims[1]]}],
                    totals={"total_seqs": 3})
    torch.save({"buffer": buffer_images(buf, to_tensors=True)}, tmp_path / "s.pt")
    back = buffer_images(safe_load(tmp_path / "s.pt")["buffer"], to_tensors=False)
    assert buf.samples[0]["images"][0] is ims[0]   # the live buffer is untouched
    assert [s["images"][0].tobytes() if s.get("images") else None for s in back.samples] == \
        [ims[0].tobytes(), None, ims[1].tobytes()]


def test_vlm_generation_never_samples_vision_tokens(tmp_path):
    """A sampled image pad would not match any image in the next forward: the hf engine's VLM path bans
    the vision tokens even where the model prefers them (here: +1e4 on the image pad's logit)."""
    from trainfit.data.image_examples import encode_image_prompt

    cfg = grpo_config(tmp_path)
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    proc = loaded.processor
    pad = proc.image_token_id

    def favour_pad(module, args, out):
        out.logits[..., pad] += 1e4
        return out

    handle = unwrap(loaded.model, peft=True).register_forward_hook(favour_pad)
    ex = stage.task.train_example(0)
    prompt = encode_image_prompt(loaded.tokenizer, proc, ex, True)
    try:
        outs = stage.engine.generate([prompt, prompt], seeds=[1, 2], images=[ex.images, ex.images]) + \
            stage.engine.generate([prompt], greedy=True, images=[ex.images]) + \
            stage.engine.generate([prompt[:5]], greedy=True)   # a text-only prompt on the VLM too
    finally:
        handle.remove()
    banned = {loaded.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                                  "<|video_pad|>")}
    assert all(c.token_ids and not set(c.token_ids) & banned for c in outs)
