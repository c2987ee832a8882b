"""The TRL benchmark harness (bench/) cannot rot: every workload runs 1 step on the tiny preset, both sides.

Skipped when trl is not installed (it is only in the `bench` extra). Each side runs in this process
(bench.sides.run_trainfit / run_trl) to stay fast; one end-to-end run goes through the runner
(subprocesses, results JSON, BENCHMARKS.md table). Besides "it runs", the checks are the ones that
keep the comparison fair: both sides see the same prompt tokens, the same SFT records in the same
order with the same loss mask (identical first-step SFT loss), and the same generated/trained token
counts from the shared meter.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

# bench/ is a directory of the repository, not part of the installed package: make it importable
# however pytest was started (`python -m pytest` adds the working directory, bare `pytest` does not).
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' checkpointing renames

pytest.importorskip("trl")

from bench import run as bench_run  # noqa: E402
from bench.sides import grpo_prompts, run_trainfit, run_trl, summarise, trl_reward_fn  # noqa: E402
from bench.workloads import WORKLOADS, prepare, quick, trainfit_epoch_order  # noqa: E402


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _both(spec, work):
    out = {}
    for side, fn in (("trainfit", run_trainfit), ("trl", run_trl)):
        raw = fn(spec, spec.seed, work / f"{spec.name}-{side}")
        out[side] = summarise(spec, side, raw, t_start=0.0)
    return out


# grpo-tiny runs through the runner in test_runner_end_to_end (the same two sides, in subprocesses).
@pytest.mark.parametrize("name", [n for n in WORKLOADS if n != "grpo-tiny" and WORKLOADS[n].engine == "hf"])
def test_workload_one_step_both_sides(name, work):
    spec = prepare(quick(WORKLOADS[name]), work)
    # GPU workloads keep their architecture family at toy shapes, on CPU.
    assert spec.steps == 1 and (spec.model == "tiny" or (spec.shrink and spec.device == "cpu"))
    res = _both(spec, work)
    for side, r in res.items():
        assert len(r["step_s"]) == 1 and r["step_s"][0] > 0, side
        assert r["peak_rss_mb"] > 0 and r["loss"][0] is not None, side
    tf, trl = res["trainfit"], res["trl"]
    if spec.kind == "grpo":
        assert tf["gen_s"][0] > 0 and trl["gen_s"][0] > 0
        assert tf["reward"][0] is not None and trl["reward"][0] is not None
        # Same prompts on both sides: the prompt part of the trained tokens matches whenever the
        # sampled completions have the same total length (always true when none stops early).
        if tf["gen_tokens"] == trl["gen_tokens"]:
            assert tf["train_tokens"] == trl["train_tokens"]
    else:
        # Same model, records, order, truncation and loss mask: with LoRA's B = 0 (or full fine-tuning)
        # the first step's loss is the same function on both sides (bf16 too).
        assert tf["loss"][0] == pytest.approx(trl["loss"][0], rel=1e-4)


def test_grpo_prompt_tokens_match_trl(work):
    """TRL tokenizes the prompts we hand it the way trainfit encodes them (plain and chat)."""
    from transformers import AutoTokenizer

    from trainfit.data.text import encode_prompt

    spec = prepare(quick(WORKLOADS["grpo-tiny"]), work)
    tok = AutoTokenizer.from_pretrained(spec.model_dir)
    for chat in (False, True):
        s = dataclasses.replace(spec, task={**spec.task, "chat": chat})
        _, task = trl_reward_fn(s)
        for row in grpo_prompts(s, task)[:4]:
            ex = task.train_example(row["index"])
            mine = encode_prompt(tok, ex, chat)
            if chat:  # GRPOTrainer._tokenize_prompts
                theirs = tok.apply_chat_template([row["prompt"]], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"][0]
            else:
                theirs = tok(text=[row["prompt"]])["input_ids"][0]
            assert list(theirs) == mine


def test_sft_record_order_is_trainfits(work):
    """The TRL side is fed records in the order trainfit's SFT stage reads them."""
    from trainfit.config import load_config
    from trainfit.train.run import build_stage
    from bench.sides import trainfit_config

    spec = prepare(dataclasses.replace(quick(WORKLOADS["sft-smollm2"]), steps=3), work)
    for seed in (0, 1):
        cfg = load_config(None, ["train.device=cpu"], base=trainfit_config(spec, seed, work / "order"))
        _, stage, _ = build_stage(cfg, work / "order")
        n = len(stage.train_items)
        assert n == spec.steps * spec.global_batch
        assert stage._epoch_order(0) == trainfit_epoch_order(n, seed)
        assert all(len(it["input_ids"]) == spec.seq_len for it in stage.train_items)  # fixed length


def test_runner_end_to_end(tmp_path):
    """`python -m bench.run NAME`: subprocess per side, results JSON with the agreed fields, markdown table."""
    md = tmp_path / "BENCHMARKS.md"
    # --max-others 0: never redo a run because other processes were busy (a loaded test machine).
    bench_run.main(["grpo-tiny", "--quick", "--max-load", "0", "--max-others", "0", "--out-dir", str(tmp_path / "results"),
                    "--md", str(md), "--work", str(tmp_path / "work")])
    r = json.loads((tmp_path / "results" / "grpo-tiny.json").read_text())
    assert {"machine", "versions", "settings", "sides", "ratio", "measurement", "command", "runs"} <= set(r)
    assert [run["side"] for run in r["runs"]] == ["trainfit", "trl"]
    assert all("loadavg_before" in run and "others_cores" in run for run in r["runs"])
    assert r["ratio"]["steps_per_s_trainfit_over_trl"] > 0 and r["versions"]["trl"]
    assert "| grpo-tiny | trainfit |" in md.read_text()


def test_permutation_p():
    # Fully separated samples of 3: the two extreme splits of C(6, 3) = 20 -> p = 2/20.
    assert bench_run.permutation_p([1.0, 1.1, 1.2], [2.0, 2.1, 2.2]) == pytest.approx(0.1)
    assert bench_run.permutation_p([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert bench_run.permutation_p([1.0], [2.0]) is None
