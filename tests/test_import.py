"""`trainfit import` (trainfit/config/importers/, app/import_command.py): real public configs of TRL, verl,
OpenRLHF and LLaMA-Factory (tests/data/import/<tool>/, each with its source link) convert into trainfit configs
that validate; a representative set plans (in-process, offline, the run's planner cache) and dry-runs through the
CLI; the printed mapping accounts for every peer key; the batch arithmetic matches numbers worked out by hand
below. All of them are planned and dry-run by bench/import_roundtrip.py, which writes docs/import.md's table.

Offline stand-ins, said where they are used: a model outside the planner's catalog is planned from the config.json
of the catalog entry with the same shapes (STAND_INS); an RL fixture's prompt file that is not on this machine
(verl's ~/data/gsm8k/train.parquet) is replaced by examples/data/word_problems.jsonl; dry-runs point the data at a
local file, and generate with rollout.engine=hf / attend with sdpa where the fixture names vLLM or flash-attention,
which this machine does not have (`trainfit plan` lists them as needed on the training machine). CPU only, no
weights: `trainfit plan` of the same configs is the command a user runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner
from conftest import roomy_disk

from trainfit.app.cli import app
from trainfit.config import load_config, valid_keys
from trainfit.config.importers import PEER_ARGS, PEERS, finish, import_config, read_source
from trainfit.config.importers.report import fixture_cells, key_table, lines
from trainfit.config.importers.shell import commands
from trainfit.config.peer_keys import answer
from trainfit.models.catalog import catalog_entries
from trainfit.plan.lengths import missing_locally

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "import"
FIXTURES = sorted(p.relative_to(DATA).as_posix() for p in DATA.glob("*/*") if p.suffix in (".sh", ".yaml"))
# Models the catalog does not name, planned from the catalog entry with the same shapes (layers, widths, heads,
# vocab): Qwen2 0.5B = Qwen2.5 0.5B, Qwen2.5-Coder 0.5B = Qwen2.5 0.5B, Llama 3 8B = Llama 3.1 8B (rope scaling aside).
STAND_INS = {"Qwen/Qwen2-0.5B-Instruct": "qwen2.5-0.5b", "Qwen/Qwen2-0.5B": "qwen2.5-0.5b",
             "Qwen/Qwen2.5-Coder-0.5B": "qwen2.5-0.5b", "OpenRLHF/Llama-3-8b-sft-mixture": "llama-3.1-8b",
             "meta-llama/Meta-Llama-3-8B": "llama-3.1-8b", "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3.1-8b"}
PROMPTS = str(ROOT / "examples" / "data" / "word_problems.jsonl")
# Gemma-2 refuses sdpa in transformers, and the planner traces with model.attn_implementation: this verl fixture
# plans with eager (its training would use flash-attention; see docs/import.md).
PLAN_OVERRIDES = {"verl/run_gemma.sh": ["model.attn_implementation=eager"]}


def _import(fixture: str, **kw):
    tool = fixture.split("/")[0]
    return import_config(str(DATA / fixture), tool, **kw)


def _models(hub_cache, cfg) -> None:
    """Every model the config loads resolves offline: catalog entries, and stand-ins for the others."""
    for name in (cfg.model.name, cfg.rl_models.reward_model, cfg.rl_models.value_model):
        if name in STAND_INS:
            hub_cache.put(name, {"config.json": json.dumps(catalog_entries()[STAND_INS[name]]["config"])})
    hub_cache.catalog(cfg)


def _planned(im) -> list[str]:
    """Overrides that let an RL config whose prompt file is not here plan on this machine."""
    path = im.values.get("task.path")
    return ([f"task.path={PROMPTS}", "task.eval_path=null", "task.num_eval=20"]
            if path and missing_locally(path) else [])


def test_there_are_at_least_three_real_configs_per_tool_each_with_its_source():
    by_tool = {t: [f for f in FIXTURES if f.startswith(t + "/")] for t in ("trl", "verl", "openrlhf", "llamafactory")}
    assert all(len(v) >= 3 for v in by_tool.values()), by_tool
    for f in FIXTURES:
        head = (DATA / f).read_text().splitlines()[0]
        assert head.startswith("# source: https://github.com/") and "/blob/" in head, f


@pytest.mark.parametrize("fixture", FIXTURES)
def test_every_fixture_converts_and_its_mapping_names_every_key(fixture):
    im = _import(fixture)
    cfg = finish(im)                       # the schema and cross-field rules accept it
    assert cfg.stage == im.stage and im.mapped and im.computed
    printed = "\n".join(lines(im))
    args = PEER_ARGS[fixture.split("/")[0]](read_source(str(DATA / fixture))[0])
    assert args, fixture
    unsaid = [k for k in args if k not in printed]
    assert not unsaid, f"{fixture}: keys neither mapped, computed nor dropped: {unsaid}"
    for d in im.dropped:                   # every drop says why
        assert d.why.strip(), d
    # the global batch is whole micro-batches on every GPU, and whole GRPO groups on every GPU
    bp = cfg.batch_plan()
    assert bp.global_batch == bp.micro_batch * bp.accumulation * bp.world_size
    assert (bp.global_batch // bp.world_size) % bp.group_size == 0


# Planned here: one or two per tool, on the architectures the shipped examples' tests trace too (Qwen2.5 0.5B and 7B,
# Qwen3 4B), so a cold planner cache costs the suite little; bench/import_roundtrip.py plans and dry-runs all of
# them (a cold cache traces 7 architectures: ~200 s on 2 shared cores) and writes docs/import.md's table.
PLANNED = ["llamafactory/qwen3_lora_sft.yaml", "llamafactory/qwen3_lora_reward.yaml",
           "openrlhf/train_reinforce_baseline_hybrid_engine.sh", "trl/example_config.yaml", "trl/dpo_lora.sh",
           "verl/run_qwen2_5-7b_math.sh", "verl/run_qwen2.5-0.5b.sh"]


@pytest.mark.parametrize("fixture", PLANNED)
def test_imported_configs_plan(fixture, hub_cache, user_plan_cache):
    from trainfit.plan import plan

    im = _import(fixture)
    cfg = load_config(None, _planned(im) + PLAN_OVERRIDES.get(fixture, []), base=im.config())
    _models(hub_cache, cfg)
    p = plan(cfg, suggest=False)
    assert p.peak > 0 and p.stage == im.stage


# (fixture, what it must become), worked out by hand from the fixture's values:
BATCHES = [
    # verl GRPO: ppo_mini_batch_size 80 prompts x n 3 = 240 completions a step; 8 GPUs -> 30 each, micro 10 ->
    # accumulation 3; kl_loss_coef 0.001 with use_kl_loss -> grpo.beta; low_var_kl -> k3.
    ("verl/run_qwen3-1.7b.sh", {"train.global_batch_size": 240, "train.micro_batch_size": 10,
                                "grpo.num_generations": 3, "distributed.num_gpus": 8, "grpo.beta": 0.001,
                                "grpo.kl_estimator": "k3", "rollout.engine": "vllm", "task.name": "dataset"}),
    # verl GRPO on 16 GPUs: 256 x 5 = 1280 completions; 1280 / 16 = 80 a GPU = micro 16 x accumulation 5.
    ("verl/run_qwen2_5-7b_math.sh", {"train.global_batch_size": 1280, "train.micro_batch_size": 16,
                                     "distributed.num_gpus": 16, "task.path": "~/data/gsm8k/train.parquet"}),
    # verl PPO (gae by default): a step is ppo_mini_batch_size 128 prompts; the older ppo_micro_batch_size 4 counts
    # both GPUs -> 2 a GPU; train_batch_size 512 / 128 = 4 optimizer steps a rollout; kl_ctrl 0.001 in the rewards.
    ("verl/run_gemma.sh", {"train.global_batch_size": 128, "train.micro_batch_size": 2, "ppo.num_mini_batches": 4,
                           "ppo.kl_coef": 0.001, "distributed.num_gpus": 2}),
    # verl PPO on 1 GPU with a critic of its own and use_kl_in_reward=False: no KL penalty.
    ("verl/run_qwen2.5-0.5b.sh", {"train.global_batch_size": 8, "ppo.num_mini_batches": 1, "ppo.kl_coef": 0.0,
                                  "rl_models.value_model": "Qwen/Qwen2.5-0.5B-Instruct", "ppo.value_lr": 1e-5}),
    # OpenRLHF DAPO-style GRPO: train_batch_size 128 completions = 16 prompts x 8; 8 actor GPUs -> 16 a GPU =
    # micro 8 x accumulation 2; max_steps = ceil(1 episode x 20000 prompts x 8 x 1 epoch / 128) = 1250;
    # eps_clip_low_high 0.2 0.27 -> epsilon 0.2, epsilon_high 0.27; --use_kl_loss with init_kl_coef 1e-3.
    ("openrlhf/train_dapo_ray_hybrid_engine.sh", {"train.global_batch_size": 128, "train.micro_batch_size": 8,
                                                  "grpo.num_generations": 8, "train.max_steps": 1250,
                                                  "grpo.epsilon": 0.2, "grpo.epsilon_high": 0.27, "grpo.beta": 1e-3,
                                                  "distributed.zero_stage": 3}),
    # OpenRLHF REINFORCE++-baseline: 1024 completions a step (128 prompts x 8) on 4 GPUs -> 256 a GPU, micro 1 ->
    # accumulation 256; max_steps = ceil(1 x 128000 x 8 x 1 / 1024) = 1000; k2 KL in the loss at 1e-5.
    ("openrlhf/train_reinforce_baseline_hybrid_engine.sh", {"train.global_batch_size": 1024,
                                                            "train.micro_batch_size": 1, "distributed.num_gpus": 4,
                                                            "train.max_steps": 1000, "grpo.advantage": "reinforce_pp",
                                                            "grpo.kl_estimator": "k2", "grpo.beta": 1e-5}),
    # OpenRLHF DPO under torchrun --nproc-per-node 8: 256 pairs a step, micro 1 -> 256 / 8 = 32 accumulation.
    ("openrlhf/train_dpo_llama.sh", {"train.global_batch_size": 256, "train.micro_batch_size": 1,
                                     "distributed.num_gpus": 8, "dpo.beta": 0.1, "data.max_seq_length": 8192}),
    # TRL GSPO: 8 a device x 2 accumulation x 1 process = 16 completions = 2 prompts x 8; ZeRO-3 from the name of
    # accelerate's config file; its dataset is in the script, so a built-in task stands in (said as computed).
    ("trl/gspo.sh", {"train.global_batch_size": 16, "train.micro_batch_size": 8, "grpo.num_generations": 8,
                     "distributed.zero_stage": 3, "grpo.importance": "sequence", "grpo.epsilon": 3e-4,
                     "grpo.epsilon_high": 4e-4, "peft.method": "lora", "peft.target_modules": ["q_proj", "v_proj"],
                     "task.name": "arithmetic", "model.dtype": "bf16"}),
    # TRL DPO with LoRA: 2 x 8 x 1 = 16 pairs a step; DPOConfig's default lr is not needed (5e-6 given).
    ("trl/dpo_lora.sh", {"train.global_batch_size": 16, "train.micro_batch_size": 2, "train.lr": 5e-6,
                         "peft.r": 32, "peft.alpha": 16, "train.eval_every": 50}),
    # TRL's YAML: SFT by default; TRL's defaults 8 a device x 1 accumulation = 8, max_length 1024; report_to none.
    ("trl/example_config.yaml", {"train.global_batch_size": 8, "train.micro_batch_size": 8,
                                 "data.max_seq_length": 1024, "logging.report_to": []}),
    # LLaMA-Factory LoRA SFT: 1 x 8 x 1 GPU = 8; max_steps = ceil(3 epochs x 1000 samples / 8) = 375;
    # warmup = round(0.1 x 375) = 38 (37.5 rounds to even); lora_target all -> all-linear; its dataset file.
    ("llamafactory/qwen3_lora_sft.yaml", {"train.global_batch_size": 8, "train.micro_batch_size": 1,
                                          "train.max_steps": 375, "train.warmup_steps": 38,
                                          "peft.target_modules": "all-linear", "data.path": "data/identity.json",
                                          "data.template": "chat", "model.dtype": "bf16"}),
    # LLaMA-Factory full SFT with ds_z3_config.json: 1 x 2 = 2 a step; ceil(3 x 1000 / 2) = 1500 steps, warmup 150.
    ("llamafactory/llama3_full_sft.yaml", {"train.global_batch_size": 2, "train.max_steps": 1500,
                                           "train.warmup_steps": 150, "distributed.zero_stage": 3,
                                           "distributed.strategy": "deepspeed", "peft.method": "none"}),
]


@pytest.mark.parametrize("fixture,expected", BATCHES, ids=[b[0] for b in BATCHES])
def test_batch_arithmetic_matches_the_hand_worked_numbers(fixture, expected):
    im = _import(fixture)
    got = {k: im.values.get(k) for k in expected}
    assert got == expected


def test_a_micro_batch_that_does_not_divide_is_lowered_and_groups_stay_whole():
    # 10 prompts x 3 = 30 completions on 4 GPUs: not whole groups a GPU -> rounded up to 36 (a multiple of
    # 4 x 3); 36 / 4 = 9 a GPU, micro 4 does not divide 9 -> 3, accumulation 3. Given as a command string.
    im = import_config("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
                       "actor_rollout_ref.actor.ppo_mini_batch_size=10 actor_rollout_ref.rollout.n=3 "
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 trainer.n_gpus_per_node=4 "
                       "data.train_files=prompts.parquet", "verl")
    assert (im.values["train.global_batch_size"], im.values["train.micro_batch_size"]) == (36, 3)
    said = {c.key: c.formula for c in im.computed}
    assert "rounded up from 30 to a multiple of 12" in said["train.global_batch_size"]
    assert "lowered from 4" in said["train.micro_batch_size"] and "= 3" in said["train.micro_batch_size"]
    assert finish(im).batch_plan().accumulation == 3


def test_the_shell_reader_follows_variables_arrays_and_here_documents():
    script = ("MODEL=\"Qwen/Qwen3-4B\"\nARGS=(\n  --pretrain ${MODEL}  # the policy\n  # --skipped 1\n  --x 2\n)\n"
              "read -r -d '' cmd <<EOF\nopenrlhf.cli.train_sft \\\n  --max_len 64\nEOF\n"
              "deepspeed --module $cmd ${ARGS[@]} --save_path $HOME/out $@\n")
    assert commands(script)[-1] == ["deepspeed", "--module", "openrlhf.cli.train_sft", "--max_len", "64",
                                    "--pretrain", "Qwen/Qwen3-4B", "--x", "2", "--save_path", "~/out"]


def test_the_cli_writes_the_config_never_over_a_file_and_it_dry_runs(tmp_path, hub_cache, user_plan_cache,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = str(DATA / "llamafactory" / "qwen3_lora_sft.yaml")
    r = CliRunner().invoke(app, ["import", src, "--from", "llamafactory"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "qwen3_lora_sft.trainfit.yaml"
    text = out.read_text()
    assert "blob/77e7f47dcf2764cb9d9265fb9716be00871c3cee" in text     # the peer file's source link is kept
    for said in ("mapped:", "lora_rank = 8 -> peft.r = 8", "computed:", "train.global_batch_size = 8:",
                 "dropped:", "ddp_timeout = 180000000:", f"wrote {out.name}"):
        assert said in r.output, said
    again = CliRunner().invoke(app, ["import", src, "--from", "llamafactory"])
    assert again.exit_code == 2 and "does not replace a file silently" in again.output
    assert out.read_text() == text
    cfg = load_config(out)
    _models(hub_cache, cfg)
    dry = CliRunner().invoke(app, ["train", str(out), "--dry-run", f"data.path={ROOT}/examples/data/chat_sample.jsonl",
                                   f"run_dir={tmp_path}/run", "train.device=cpu"])
    assert dry.exit_code == 0 and "would train 1 stage" in dry.output, dry.output


# A representative dry-run per remaining tool: (fixture, overrides for this machine, as the module docstring says).
DRY_RUNS = [
    ("trl/dpo_lora.sh", ["data.path=PAIRS"]),
    ("verl/run_qwen2.5-0.5b.sh", ["rollout.engine=hf", f"task.path={PROMPTS}", "task.eval_path=null",
                                  "task.num_eval=20"]),
    ("openrlhf/train_reinforce_baseline_hybrid_engine.sh", ["rollout.engine=hf", f"task.path={PROMPTS}",
                                                            "task.eval_path=null", "task.num_eval=20",
                                                            "task.columns={}"]),
]


@pytest.mark.parametrize("fixture,overrides", DRY_RUNS, ids=[d[0] for d in DRY_RUNS])
def test_imported_configs_dry_run(fixture, overrides, tmp_path, hub_cache, user_plan_cache, monkeypatch):
    out = tmp_path / "imported.yaml"
    tool = fixture.split("/")[0]
    r = CliRunner().invoke(app, ["import", str(DATA / fixture), "--from", tool, "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["written"] == str(out)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "chosen": str(i + 1), "rejected": str(i)}) + "\n"
                             for i in range(40)))
    overrides = [o.replace("PAIRS", str(pairs)) for o in overrides] + [f"run_dir={tmp_path}/run", "train.device=cpu"]
    _models(hub_cache, load_config(out, overrides))
    roomy_disk(monkeypatch)   # an 8B config dry-run on this CPU: its checkpoints are the training machine's disk's
    dry = CliRunner().invoke(app, ["train", str(out), "--dry-run", *overrides])
    assert dry.exit_code == 0 and "would train 1 stage" in dry.output, dry.output


def test_errors_are_one_paragraph_and_exit_2(tmp_path):
    cases = {
        "unknown tool": (["import", str(DATA / "trl" / "gspo.sh"), "--from", "axolotl"], "choose one of trl, verl"),
        "missing file": (["import", str(tmp_path / "nope.yaml"), "--from", "trl"], "does not exist"),
        "a directory": (["import", str(DATA), "--from", "trl"], "is a directory"),
        "unknown stage": (["import", str(DATA / "trl" / "gspo.sh"), "--from", "trl", "--stage", "sftt"],
                          "not a trainfit stage"),
        "no command": (["import", "echo hello world", "--from", "verl"], "main_ppo"),
        # GRPO needs groups of at least 2: verl's rollout.n=1 with the grpo estimator cannot be made valid
        "invalid": (["import", "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
                     "data.train_files=p.parquet", "--from", "verl", "-o", str(tmp_path / "x.yaml")],
                    "imported into trainfit is not valid"),
    }
    for what, (args, words) in cases.items():
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2, (what, r.output)
        err = r.output[r.output.index("error:"):]
        assert words in err and "Traceback" not in r.output and err.count("\nerror:") == 0, (what, err)
    assert not (tmp_path / "x.yaml").exists()


def test_every_key_the_fixtures_map_is_answered_by_the_unknown_key_error():
    # One table (config/peer_keys.py): a peer key the importer maps, pasted into a trainfit config, is answered
    # with the trainfit key the importer wrote for it.
    keys = set(valid_keys())
    for fixture in FIXTURES:
        for m in _import(fixture).mapped:
            if m.peer_key in keys:     # LLaMA-Factory's `stage` is trainfit's word too: never unknown
                continue
            said = answer(m.peer_key, m.peer_value)
            assert said and m.key in said, (fixture, m.peer_key, said)


def test_the_docs_hold_the_generated_key_tables_and_round_trip_rows():
    # docs/import.md is written by bench/import_roundtrip.py --write; its conversion columns and key tables are
    # recomputed here, so a change to the table or an importer shows as a stale doc.
    docs = (ROOT / "docs" / "import.md").read_text()
    for peer in PEERS.values():
        assert key_table(peer) in docs, f"{peer}'s key table is stale: run bench/import_roundtrip.py --write"
    for fixture in FIXTURES:
        im = _import(fixture)
        cells = fixture_cells(fixture, im.source_link, im.stage, finish(im).batch_plan().describe())
        assert cells in docs, f"{fixture}'s round-trip row is stale: run bench/import_roundtrip.py --write"
