"""Whole plans: every shipped example is planned, the phases and verdicts make sense, suggestions
lower the peak, and the CLI (`trainfit plan`, `trainfit hardware`) works."""

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-plan-test-"))

import pytest
from typer.testing import CliRunner

from trainfit.config import load_config
from trainfit.plan import plan

from plan_rows_helpers import check_rows

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GB = 1e9


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def cfg_of(name, *overrides):
    return load_config(EXAMPLES / name, list(overrides))


@pytest.mark.parametrize("path", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_plans(path):
    from trainfit.config import expand_stages

    cfg = load_config(EXAMPLES / path)
    for stage_cfg in expand_stages(cfg):
        p = plan(stage_cfg, suggest=False)
        assert p.peak > 0 and p.phases["train"].total > 0
        json.dumps(p.to_dict(), default=str)
        check_rows(p, stage_cfg)   # the rows add up to the totals and name what they hold (issue 46)


def test_qwen3_8b_grpo_lora_shares_an_h200_with_vllm():
    p = plan(cfg_of("qwen3_8b_grpo_lora_h200.yaml"), suggest=False)
    assert p.gpu.startswith("H200") and p.fits
    roll, train = p.phases["rollout"], p.phases["train"]
    engine = next(i for i in p.items if i.group == "engine")
    assert engine.rollout == pytest.approx(0.5 * p.gpu_memory, rel=0.01)  # vLLM takes half the card
    assert engine.train < 2 * GB and engine.cpu > 15 * GB  # asleep: weights in CPU RAM (level 1)
    assert roll.total > train.total
    # sleep level 0 keeps the whole envelope through training
    awake = plan(cfg_of("qwen3_8b_grpo_lora_h200.yaml", "rollout.sleep_level=0"), suggest=False)
    assert awake.phases["train"].total > train.total + 0.4 * p.gpu_memory


def test_async_vllm_keeps_the_engine_awake_through_training_and_offers_no_sleep():
    """rollout.mode=async with the colocated vLLM engine: its worker samples while the step trains, so the plan
    holds vLLM's whole envelope through the training phase, and neither suggestions nor `fit` offer sleep
    levels, which async does not use."""
    from trainfit.plan.fit_space import Allow, _combos
    from trainfit.plan.suggest import _candidates

    cfg = cfg_of("qwen3_8b_grpo_lora_h200.yaml", "rollout.mode=async")
    p = plan(cfg, suggest=False)
    engine = next(i for i in p.items if i.group == "engine")
    assert engine.train == engine.rollout == pytest.approx(0.5 * p.gpu_memory, rel=0.01) and engine.cpu == 0
    assert "awake" in engine.name
    sync = plan(cfg_of("qwen3_8b_grpo_lora_h200.yaml", "rollout.sleep_level=0"), suggest=False)
    assert p.phases["train"].total > sync.phases["train"].total   # the worker's copy on top of the awake engine
    for mode, sleeps in (("sync", {0, 1}), ("async", {0})):
        c = cfg_of("qwen3_8b_grpo_lora_h200.yaml", f"rollout.mode={mode}", "rollout.sleep_level=0")
        assert {x["rollout.sleep_level"] for x in _combos(c, Allow(), {}) if isinstance(x, dict)} == sleeps
        offered = any("rollout.sleep_level=1" in ovs for _, ovs in _candidates(c))
        assert offered == (mode == "sync")


def test_ppo_full_vs_dora():
    full = plan(cfg_of("ppo_7b_full.yaml"), suggest=False)
    dora = plan(cfg_of("ppo_7b_dora_zero3.yaml"), suggest=False)
    groups = {i.group for i in full.items}
    assert {"policy", "value", "reference", "reward"} <= groups
    assert not any(i.group == "reference" and i.train for i in dora.items)  # adapters disabled = reference
    assert dora.trainable_params < 0.01 * full.trainable_params
    assert full.fits and dora.fits
    # the same job without ZeRO-3 does not fit the full fine-tuning on 80 GB cards
    assert not plan(cfg_of("ppo_7b_full.yaml", "distributed.zero_stage=0", "distributed.strategy=ddp"),
                    suggest=False).fits


def test_sft_7b_zero2_offload_on_one_80gb_card():
    p = plan(cfg_of("sft_7b_zero2_offload.yaml"), suggest=False)
    assert p.fits and p.cpu_ram > 100 * GB  # fp32 master + moments (+ fp32 grads) on the CPU
    no_offload = plan(cfg_of("sft_7b_zero2_offload.yaml", "distributed.offload_optimizer=false"), suggest=False)
    assert not no_offload.fits and no_offload.cpu_ram == 0


def test_qwen3_4b_grpo_4bit_on_a_24gb_card():
    p = plan(cfg_of("qwen3_4b_grpo_4bit.yaml"), suggest=False)
    assert p.fits and p.gpu.startswith("RTX 4090")
    bf16 = plan(cfg_of("qwen3_4b_grpo_4bit.yaml", "model.quantization=none"), suggest=False)
    weights = lambda q: next(i.train for i in q.items if i.name.startswith("policy weights"))  # noqa: E731
    # NF4 linears (~4.1 bits) plus the tied [151936, 2560] embedding in fp32 (the k-bit upcast): ~0.43x
    assert weights(p) < 0.45 * weights(bf16)


def test_does_not_fit_lists_changes_that_lower_the_peak():
    p = plan(cfg_of("qwen3_4b_grpo_4bit.yaml", "model.quantization=none", "peft.method=none",
                    "model.gradient_checkpointing=false", "train.optimizer=adamw"))
    assert p.fits is False and p.suggestions
    assert all(s.saving > 0 for s in p.suggestions)
    assert any(s.fits for s in p.suggestions)
    best = next(s for s in p.suggestions if s.fits)
    fixed = plan(cfg_of("qwen3_4b_grpo_4bit.yaml", "model.quantization=none", "peft.method=none",
                        "model.gradient_checkpointing=false", "train.optimizer=adamw", *best.overrides),
                 suggest=False)
    assert fixed.fits


def test_vllm_without_room_for_kv_cache_is_a_problem():
    p = plan(cfg_of("qwen3_8b_grpo_lora_h200.yaml", "rollout.gpu_memory_utilization=0.1"), suggest=False)
    assert p.fits is False and "gpu_memory_utilization" in p.problems[0]


def test_num_gpus_and_margin():
    one = plan(cfg_of("ppo_7b_full.yaml"), num_gpus=8, suggest=False)
    four = plan(cfg_of("ppo_7b_full.yaml"), num_gpus=4, suggest=False)
    assert four.peak > one.peak  # ZeRO-3 shards over fewer GPUs
    tight = plan(cfg_of("ppo_7b_full.yaml"), margin=0.5, suggest=False)
    assert tight.budget == int(tight.gpu_memory * 0.5)


runner = CliRunner()


def _app():
    from trainfit.app.cli import app

    return app


def test_cli_plan_table_json_png(tmp_path):
    ex = str(EXAMPLES / "qwen3_4b_grpo_4bit.yaml")
    r = runner.invoke(_app(), ["plan", ex, "--gpu", "rtx4090"])
    assert r.exit_code == 0, r.output
    assert "FITS" in r.output and "KV cache" in r.output
    r = runner.invoke(_app(), ["plan", ex, "--json", "--png", str(tmp_path / "plan.png")])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["verdict"] == "FITS" and set(d["phases"]) == {"rollout", "train"}
    assert (tmp_path / "plan.png").stat().st_size > 1000


def test_cli_errors_are_one_paragraph(tmp_path):
    ex = str(EXAMPLES / "qwen3_4b_grpo_4bit.yaml")
    r = runner.invoke(_app(), ["plan", ex, "--gpu", "tpu-v9"])
    assert r.exit_code == 2 and "unknown GPU" in r.output and "Traceback" not in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage: sft\nmodel: {name: nobody/nothing-1b}\ntask: {name: arithmetic}\n")
    r = runner.invoke(_app(), ["plan", str(bad)])
    assert r.exit_code == 2 and "nobody/nothing-1b" in r.output and "Hugging Face cache" in r.output
    assert "Traceback" not in r.output


def test_cli_hardware_ranks_setups():
    r = runner.invoke(_app(), ["hardware", str(EXAMPLES / "qwen3_4b_grpo_4bit.yaml"), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert len(rows) == 9 * 4
    fitting = [x for x in rows if x["fits"]]
    assert fitting and rows[0]["fits"] and rows[0]["step_s"] == min(x["step_s"] for x in fitting)
    r = runner.invoke(_app(), ["hardware", str(EXAMPLES / "qwen3_4b_grpo_4bit.yaml")])
    assert r.exit_code == 0 and "roofline" in r.output
    # The 4-bit base is bitsandbytes on the card that trains, installed here or not (issue 36).
    assert "needed on the training machine: bitsandbytes (model.quantization=4bit" in " ".join(r.output.split())


def test_hardware_orders_the_setups_that_do_not_fit_by_step_time_too():
    # Issue 36: the rows that do not fit were ordered by how far over budget they are, so a slow card
    # came before a fast one. Each group is fastest first now.
    from trainfit.plan.hardware import CATALOG
    from trainfit.plan.setups import rank_setups

    cards = [CATALOG[k] for k in ("a100-40gb", "h100-80gb")]
    rows = rank_setups(cfg_of("qwen3_8b_grpo_lora_h200.yaml"), cards, (1, 2))
    fits = [x["fits"] is True for x in rows]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    for group in (True, False):
        times = [x["step_s"] for x in rows if (x["fits"] is True) == group and x["step_s"] is not None]
        assert len(times) >= 2 and times == sorted(times), (group, times)


# Lengths from the data (plan/lengths.py): the planner tokenizes what the trainer will tokenize.

def _tiny(tmp_path, stage, **overrides):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import tiny_config

    return tiny_config(tmp_path, stage, **overrides)


def test_grpo_is_planned_at_the_prompts_the_trainer_builds(tmp_path, monkeypatch):
    """One real GRPO step on CPU: the planner's longest prompt is the longest prompt the engine got,
    and no training micro-batch is wider than the planned sequence; the caps are the worst case."""
    import trainfit.models.logprobs as lp
    from trainfit.train.loop import accumulate, seed_step
    from trainfit.train.run import build_stage

    reward = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"
    cfg = _tiny(tmp_path, "grpo", **{"task.chat": True, "task.rewards": f"[{reward}]", "train.max_steps": 1,
                                     "train.micro_batch_size": 4, "rollout.max_new_tokens": 6})
    p = plan(cfg, gpu="h100", suggest=False)
    assert p.lengths["source"] == "data" and p.lengths["rows"] == cfg.batch_plan().prompts_per_step
    assert p.seq_len == p.prompt_len + 6 < cfg.rollout.max_prompt_length
    caps = plan(cfg, gpu="h100", suggest=False, from_data=False)
    assert caps.seq_len == cfg.rollout.max_prompt_length + 6 and caps.worst_case is None
    assert p.worst_case["seq_len"] == caps.seq_len and p.worst_case["peak"] == caps.peak > p.peak
    assert any("Worst case at the caps" in n for n in p.notes)

    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    prompts, widths = [], []
    generate, tensors = stage.engine.generate, lp.batch_tensors
    monkeypatch.setattr(stage.engine, "generate", lambda ps, **kw: prompts.extend(ps) or generate(ps, **kw))
    monkeypatch.setattr(lp, "batch_tensors", lambda s, *a: widths.append(max(len(x["input_ids"]) for x in s))
                        or tensors(s, *a))
    seed_step(cfg.train.seed, 0)
    accumulate(loaded.model, stage.prepare(0), cfg.train.micro_batch_size, stage.loss)
    assert max(len(x) for x in prompts) == p.prompt_len
    assert widths and max(widths) <= p.seq_len


def test_sft_jsonl_is_planned_at_its_longest_item(tmp_path):
    import json as _json

    from trainfit.train.run import build_stage

    rows = [{"prompt": "What is " + "very " * (i % 7) + "big?", "completion": "It is " + "huge " * i}
            for i in range(12)]
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(_json.dumps(r) for r in rows) + "\n")
    cfg = _tiny(tmp_path, "sft", **{"task.name": "null", "data.path": str(data), "data.max_seq_length": 512})
    p = plan(cfg, gpu="h100", suggest=False)
    _, stage, _ = build_stage(cfg, tmp_path / "stage")
    longest = max(len(it["input_ids"]) for it in stage.train_items + stage.eval_items)
    assert p.lengths["source"] == "data" and p.seq_len == longest < 512 and p.worst_case["seq_len"] == 512
    short = plan(_tiny(tmp_path, "sft", **{"task.name": "null", "data.path": str(data), "data.max_seq_length": 16}),
                 gpu="h100", suggest=False)
    assert short.seq_len == 16 and short.worst_case is None  # every long item is truncated to the cap


def test_lengths_fall_back_to_the_caps_and_are_cached(tmp_path, monkeypatch):
    import trainfit.plan.lengths as L

    # A hub model whose tokenizer is not in the local cache: nothing is downloaded, the caps are planned.
    hub = _tiny(tmp_path, "grpo", **{"model.name": "Qwen/Qwen3-0.6B"})
    p = plan(hub, suggest=False)
    assert p.lengths["source"] == "caps" and p.worst_case is None
    assert p.seq_len == hub.rollout.max_prompt_length + hub.rollout.max_new_tokens
    assert any("not available locally" in n for n in p.notes)
    assert plan(_tiny(tmp_path, "pretrain", **{"task.name": "null", "data.path": "x.txt"}),
                suggest=False).lengths["source"] == "packed"
    # Measured once: later plans read the process memo, then the disk cache, never the tokenizer.
    cfg = _tiny(tmp_path, "grpo", **{"task.seed": 7})
    first = plan(cfg, suggest=False)
    L._MEMO.clear()
    monkeypatch.setattr(L, "_tokenizer", lambda cfg: (_ for _ in ()).throw(AssertionError("re-tokenized")))
    again = plan(cfg, suggest=False)
    assert again.lengths == first.lengths and again.lengths["source"] == "data"


def test_cli_plan_prints_the_worst_case(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("stage: grpo\nmodel: {name: 'preset:tiny'}\ntask: {name: arithmetic, chat: true}\n"
                   "train: {global_batch_size: 16, micro_batch_size: 8, device: cpu}\n")
    r = runner.invoke(_app(), ["plan", str(cfg), "--gpu", "rtx4090"])
    assert r.exit_code == 0, r.output
    assert "from the data" in r.output and "worst case at the caps (576 tokens" in r.output


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_sharded_grpo_plans_its_reference_copy_sharded_too(strategy):
    # GRPO's frozen reference copy is sharded like the policy under FSDP / ZeRO-3 (train/frozen.py): each of
    # 4 ranks holds a quarter of it; DDP keeps it whole on every rank, as it keeps the trained weights.
    def ref_bytes(*over):
        cfg = cfg_of("grpo_lora.yaml", "peft.method=none", "grpo.beta=0.04", "train.micro_batch_size=8", *over)
        return sum(i.train for i in plan(cfg, suggest=False).items if i.group == "reference")

    one = ref_bytes()
    zero = ["distributed.zero_stage=3"] if strategy == "deepspeed" else []
    sharded = ref_bytes(f"distributed.strategy={strategy}", "distributed.num_gpus=4", *zero)
    assert one > 0 and sharded == pytest.approx(one / 4, rel=0.01)
    assert ref_bytes("distributed.strategy=ddp", "distributed.num_gpus=4") == one
