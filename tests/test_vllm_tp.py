"""vLLM tensor parallel, colocated under torchrun (CPU, gloo): with rollout.tensor_parallel_size=2 the two
trainer ranks share one vLLM engine sharded over them (distributed_executor_backend=external_launcher; vLLM's
CPU worker runs its tensor-parallel all-reduces over gloo / shared memory). GRPO trains full weights under
FSDP2, then LoRA under DDP with held-out evaluations; every rollout round pushes the weights into both shards
and the sync check passes, and the samples (and the greedy evaluations) are the ones a single process with a
TP-1 engine produces.

Why they should be equal: every completion carries its own seed (from the run's seed and its index in the
global batch, train/grpo.py), and vLLM draws a seeded request's tokens from that request's own generator,
whatever the batch or the sharding. What TP changes is the order of the sums in the row-parallel layers
(all-reduce of partial sums): fp32 logits that differ by ~1e-7, which flip a sampled token only if its
uniform draw falls that close to a bin edge, or a greedy one at a near-tie. vLLM promises no bitwise equality
across TP sizes; over the ~200 tokens compared here such a flip is very unlikely, and it would show as a
failure to look at, not a pass.

Runs by `make test-vllm` (.venv-vllm); skips without vllm. Two interpreters import vLLM and start an engine
a stage each, then the reference trains in this process: 165-210 s on this shared 2-core machine (~95 s CPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import LAUNCHER_VARS, tiny_config
from serve_helpers import free_port
from test_distributed import train, train_here, write
from trainfit.train.report import read_metrics

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=(
    "needs vllm: `make test-vllm` builds .venv-vllm with vLLM's CPU build and runs these (see docs/serve.md)"))

REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"


def grpo_config(tmp_path: Path) -> Path:
    """GRPO, two steps, on preset:small (head_dim 32: vLLM's attention needs >= 32; 8 heads, 4 a shard) in fp32
    on CPU. Rank 0 logs its 4 completions a step; one rank logs the first 4 of the global 8, the same examples."""
    return write(tiny_config(tmp_path, "grpo", **{
        "model.name": "preset:small", "rollout.engine": "vllm", "rollout.max_new_tokens": 6,
        "task.rewards": f"[{REWARD}]", "task.num_eval": 0, "train.max_steps": 2, "train.lr": 0.05,
        "train.micro_batch_size": 4, "rollout.sync_tolerance": 1e-3, "logging.save_completions": 4}),
        tmp_path / "c.yaml")


def stages(full: str = "", lora: str = "") -> str:
    """Two stages (one launch, one reference run, and a stage's engine closed while the run goes on): full
    fine-tuning, then LoRA on its result with held-out evaluations (greedy); each with its strategy, if given."""
    def strategy(name: str) -> str:
        return f", distributed: {{strategy: {name}}}" if name else ""
    return (f"stages=[{{stage: grpo{strategy(full)}}}, "
            f"{{stage: grpo, peft: {{method: lora, r: 4}}, task: {{num_eval: 4}}{strategy(lora)}}}]")


def completions(stage_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (stage_dir / "completions.jsonl").read_text().splitlines()]


def train_steps(stage_dir: Path) -> list[dict]:
    return [m for m in read_metrics(stage_dir / "metrics.jsonl") if m["kind"] == "train"]


def test_two_ranks_share_a_tensor_parallel_engine_that_samples_what_one_engine_samples(tmp_path, monkeypatch):
    # An engine started in this process earlier (another module's fixture) left torchrun's variables for a
    # world of one in the environment: `trainfit train` would take itself for that world's one rank.
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    config = grpo_config(tmp_path)
    # Full fine-tuning under FSDP2 (the push gathers each tensor from the shards); LoRA under DDP, where an
    # evaluation would run on rank 0 alone but the TP engine needs both ranks of its group.
    # A port of its own: torchrun's default one may be taken between the check and the bind on a shared machine.
    two = train(config, f"run_dir={tmp_path / 'two'}", stages(full="fsdp", lora="ddp"), "distributed.num_gpus=2",
                f"distributed.master_port={free_port()}", "rollout.tensor_parallel_size=2")
    assert two.returncode == 0, two.stderr[-3000:]
    out = two.stdout + two.stderr
    # vLLM's own account: each stage, both ranks started an engine of 2 shards, in one tensor-parallel group.
    assert out.count("tensor_parallel_size=2, pipeline_parallel_size=1") == 4
    assert "rank 0 in world size 2 is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 0" in out
    # vLLM's teardown would take the trainer's process group with it (rollout/vllm_launcher.py): the second
    # stage and the end of the run found it there.
    assert "Invalid process group" not in out
    train_here(config, f"run_dir={tmp_path / 'one'}", stages())   # one process, a TP-1 engine, the same seeds

    for stage in ("0-grpo", "1-grpo"):   # full fine-tuning, then LoRA
        steps = train_steps(tmp_path / "two" / stage)
        assert [m["step"] for m in steps] == [1, 2]
        # Each round's weights (at step 2 the trained ones: FSDP2 shards gathered per tensor, or the adapter)
        # reached both shards: the engine samples with the trainer's log-probs.
        assert all(m["sync_logp_diff"] < 1e-3 for m in steps), stage
        one = completions(tmp_path / "one" / stage)
        assert len(one) == 8 and completions(tmp_path / "two" / stage) == one, stage
        # and the other rank's completions too: the rewards average each step's whole global batch
        assert [m["reward"] for m in steps] == [m["reward"] for m in train_steps(tmp_path / "one" / stage)], stage
    assert (tmp_path / "two" / "1-grpo" / "final" / "adapter_model.safetensors").is_file()
    # The held-out evaluations (greedy, all ranks of the group joining) judged what one engine generates.
    evals = [[{k: v for k, v in m.items() if k.startswith(("accuracy", "eval_"))}
              for m in read_metrics(tmp_path / run / "1-grpo" / "metrics.jsonl") if m["kind"] == "eval"]
             for run in ("one", "two")]
    assert len(evals[0]) == 2 and evals[0][0] and evals[1] == evals[0]
