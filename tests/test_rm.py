"""Reward-model training (stage rm): the Bradley-Terry loss, learning a hand-built preference, a final
directory plain transformers loads, micro-batch invariance, and the planner against a real CPU step."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from rich.console import Console

from trainfit.algos import bradley_terry_loss
from trainfit.config import ConfigError, load_config
from trainfit.train.run import run_pipeline

QUIET = Console(file=open("/dev/null", "w"))


def pairs_file(path: Path, n: int = 160, seed: int = 0) -> Path:
    # The preferred answer ends in " yes", the other in " no": learnable from the last tokens alone.
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "chosen": f"{a + b} yes", "rejected": f"{a + b} no"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rm_config(tmp_path, **over):
    tmp_path.mkdir(parents=True, exist_ok=True)
    base = {"run_dir": str(tmp_path / "run"), "stage": "rm", "model.name": "preset:tiny",
            "data.path": str(pairs_file(tmp_path / "pairs.jsonl")), "data.eval_fraction": 0.2,
            "train.device": "cpu", "train.max_steps": 25, "train.global_batch_size": 16,
            "train.micro_batch_size": 8, "train.lr": 3e-3, "logging.progress": "false", "logging.plot": "false",
            "logging.report_to": "none"}
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def test_bradley_terry_hand_worked():
    # Pairs (r_c, r_r) = (1, 0) and (0, 0): -log sigmoid(1) = log(1 + e^-1) = 0.313262, -log sigmoid(0)
    # = log 2 = 0.693147; sum 1.006409 over 4 pairs in the whole step = 0.251602. Correct: 1 (a tie
    # is not correct); margins 1 + 0 = 1.
    loss, m = bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), total_pairs=4)
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(2)) / 4, rel=1e-6)
    assert (m["correct"].item(), m["margin"].item(), m["pairs"].item()) == (1.0, 1.0, 2.0)
    with pytest.raises(ValueError):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))


def test_reward_model_learns_a_preference_and_saves_a_plain_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = rm_config(tmp_path, **{"peft.method": "lora", "peft.r": 8})
    result = run_pipeline(cfg, console=QUIET)[0]
    assert result.last_eval["accuracy"] >= 0.95 and result.last_eval["eval_margin"] > 1.0
    assert result.last_eval["eval_loss"] < result.first_eval["eval_loss"]
    # The final directory is a plain sequence classifier (adapters merged) that ranks the pair the same way.
    model = AutoModelForSequenceClassification.from_pretrained(str(result.final_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(result.final_dir))
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    from trainfit.tasks.pairs import encode_pairs

    pair = encode_pairs([{"prompt": "3+4=", "chosen": "7 yes", "rejected": "7 no"}], tok, 64, False)[0][0]
    with torch.no_grad():
        r = [model(input_ids=torch.tensor([pair[k]])).logits.item() for k in ("chosen", "rejected")]
    assert r[0] > r[1]


def test_micro_batches_do_not_change_the_update(tmp_path):
    from safetensors.torch import load_file

    finals = []
    for micro in (1, 4):
        cfg = rm_config(tmp_path / f"m{micro}", **{"train.max_steps": 2, "train.global_batch_size": 4,
                                                     "train.micro_batch_size": micro, "data.eval_fraction": 0.0})
        finals.append(load_file(str(run_pipeline(cfg, console=QUIET)[0].final_dir / "model.safetensors")))
    a, b = (torch.cat([f[k].flatten().double() for k in sorted(f)]) for f in finals)
    assert (a - b).norm() / a.norm() < 1e-5


def test_bad_pair_rows_are_config_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x", "chosen": "y"}) + "\n")
    with pytest.raises(ConfigError, match="chosen.*rejected"):
        run_pipeline(rm_config(tmp_path, **{"data.path": str(tmp_path / "bad.jsonl")}), console=QUIET)
    (tmp_path / "same.jsonl").write_text(json.dumps({"prompt": "x", "chosen": "y", "rejected": "y"}) + "\n" * 2)
    with pytest.raises(ConfigError, match="same tokens"):
        run_pipeline(rm_config(tmp_path, **{"data.path": str(tmp_path / "same.jsonl")}), console=QUIET)
    with pytest.raises(ConfigError, match="data.path"):
        load_config(None, ["stage=rm"])


def _plan_and_real_step(cfg) -> tuple:
    """(the plan of `cfg`, the peak live tensor bytes of one real optimizer step of stage rm on CPU, the
    stage), as bench/plan_accuracy.py measures."""
    from trainfit.models.policy import trainable_parameters
    from trainfit.plan import plan
    from trainfit.plan.tracker import step_peak
    from trainfit.models.reward import load_reward_model
    from trainfit.train.loop import accumulate, make_optimizer
    from trainfit.train.rm import RMStage

    torch.manual_seed(0)
    loaded = load_reward_model(cfg.model, cfg.peft, torch.device("cpu"))
    stage = RMStage(cfg, loaded.model, loaded.tokenizer, torch.device("cpu"))
    params = trainable_parameters(loaded.model)
    opt = make_optimizer(params, cfg.train)

    def one_step():
        accumulate(loaded.model, stage.prepare(0), cfg.train.micro_batch_size, stage.loss)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()  # optimizer state exists from here on
    return plan(cfg, gpu="h100", suggest=False), step_peak(one_step, loaded.model, opt), stage


def test_plan_matches_a_real_reward_model_step(tmp_path):
    """The planner's train phase for stage rm (score head, 2 x micro sequences per forward) against the
    peak of live tensor bytes of one real optimizer step on CPU, every side at the length cap."""
    long = tmp_path / "long.jsonl"
    words = "one two three four five six seven eight nine ten".split()
    # Answers longer than data.max_seq_length that differ at their start: every side is cut to 128 tokens.
    rows = [{"prompt": "q", "chosen": "yes " + " ".join(random.Random(i).choices(words, k=150)),
             "rejected": "no " + " ".join(random.Random(i).choices(words, k=150))} for i in range(8)]
    long.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = rm_config(tmp_path, **{"model.name": "preset:small", "model.dtype": "fp32", "data.path": str(long),
                                 "data.max_seq_length": 128, "data.eval_fraction": 0.0,
                                 "train.global_batch_size": 8, "train.micro_batch_size": 4})
    p, measured, stage = _plan_and_real_step(cfg)
    assert all(len(pair["chosen"]) == 128 for pair in stage.pairs)  # every side at the length planned
    assert p.phases["train"].allocated / measured - 1 == pytest.approx(0.0, abs=0.10)


@pytest.mark.parametrize("source", ["jsonl", "task"])
def test_plan_from_the_pairs_lengths_matches_a_real_step(tmp_path, source):
    """Pairs far shorter than data.max_seq_length (512): the plan measures the pairs the stage trains
    on (JSONL rows less the held-out split, or pairs made from the task) with the run's tokenizer and
    plans their longer side, within 10% of a real CPU step; planned at the cap it would be far above."""
    over = {"model.name": "preset:small", "model.dtype": "fp32", "train.global_batch_size": 16,
            "train.micro_batch_size": 16}
    if source == "jsonl":
        rng = random.Random(1)
        # Every rejected side is the prompt + the same ten words: each micro-batch pads to about the longest pair.
        rows = [{"prompt": f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=", "chosen": "yes",
                 "rejected": "one two three four five six seven eight nine ten"} for _ in range(80)]
        (tmp_path / "short.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        over.update({"data.path": str(tmp_path / "short.jsonl"), "data.eval_fraction": 0.2})
    else:
        over.update({"data.path": "null", "task.name": "arithmetic", "task.max_operand": 99, "task.num_eval": 20,
                     "train.max_steps": 20})
    cfg = rm_config(tmp_path, **over)
    p, measured, stage = _plan_and_real_step(cfg)
    longest = max(max(len(q["chosen"]), len(q["rejected"])) for q in stage.pairs)
    assert p.lengths["source"] == "data" and p.seq_len == longest < cfg.data.max_seq_length // 4
    assert p.phases["train"].allocated / measured - 1 == pytest.approx(0.0, abs=0.10)
    assert p.worst_case["phases"]["train"]["allocated"] > 1.5 * measured  # the cap is no stand-in


def test_task_pairs_at_are_the_rows_the_trainer_makes():
    from trainfit.config import TaskConfig
    from trainfit.tasks.pairs import task_pairs, task_pairs_at
    from trainfit.tasks import build_task

    task = build_task(TaskConfig(name="arithmetic", max_operand=99, num_eval=20))
    rows = task_pairs(task, range(300), seed=5)
    at = [0, 17, 150, 299]
    assert task_pairs_at(task, 300, at, seed=5) == [rows[i] for i in at]


def test_pairs_from_a_task(tmp_path):
    """Without data.path, stage rm makes pairs from task.name: the answer chosen, a near miss rejected
    (the task's own check says which is right), the held-out problems for eval, the same rows again
    for the same seed; and stage rm trains on them (ranking arithmetic answers takes the pipeline's
    thousands of steps from an SFT model: examples/ppo_pipeline_tiny.yaml, tests/test_ppo_pipeline.py)."""
    from trainfit.config import TaskConfig
    from trainfit.tasks.pairs import task_pairs
    from trainfit.tasks import build_task

    task = build_task(TaskConfig(name="arithmetic", max_operand=9, num_eval=20))
    rows = task_pairs(task, range(50), seed=3)
    assert rows == task_pairs(task, range(50), seed=3) and rows != task_pairs(task, range(50), seed=4)
    for i, r in enumerate(rows):
        ex = task.train_example(i)
        assert r["prompt"] == ex.prompt and task.is_correct(r["chosen"], ex) and not task.is_correct(r["rejected"], ex)
        assert 1 <= abs(int(r["rejected"]) - int(ex.answer)) <= 10
    held = task_pairs(task, (), seed=3, held_out=True)
    assert [r["prompt"] for r in held] == [ex.prompt for ex in task.eval_examples()]

    cfg = rm_config(tmp_path, **{"data.path": "null", "task.name": "arithmetic", "task.max_operand": 9,
                                 "task.num_eval": 20, "train.max_steps": 2})
    result = run_pipeline(cfg, console=QUIET)[0]
    assert result.steps == 2 and set(result.last_eval) == {"accuracy", "eval_margin", "eval_loss"}
    assert (result.final_dir / "model.safetensors").exists()


@pytest.mark.parametrize("method", ["none", "lora"])
def test_plan_counts_the_reward_model_the_trainer_counts(tmp_path, method):
    """Stage rm trains a sequence classifier: the plan counts its backbone, score head and adapters
    as count_parameters does on the loaded model (not the causal LM's count)."""
    from trainfit.models.policy import count_parameters
    from trainfit.plan import plan
    from trainfit.models.reward import load_reward_model

    cfg = rm_config(tmp_path, **{"peft.method": method})
    counts = plan(cfg, gpu="h100", suggest=False).counts
    loaded = load_reward_model(cfg.model, cfg.peft, torch.device("cpu"))
    assert [(c.model, c.params, c.trainable) for c in counts] == [("reward model", *count_parameters(loaded.model))]
