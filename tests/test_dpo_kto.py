"""Stage dpo with dpo.loss_type=kto on unpaired rows {prompt, completion, label} (train.device=cpu,
preset:tiny): the stage's loss against KTO's formula written out here, a short run, the data check and
the trainer agreeing on the errors, and the planner's one sequence a sample against a real step."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from test_dpo import QUIET, dpo_config, train_losses
from trainfit.app.cli import app
from trainfit.config import ConfigError, to_yaml
from trainfit.train.datacheck import check_stage
from trainfit.train.run import run_pipeline


def unpaired_file(path: Path, n: int = 48, seed: int = 0, chat: bool = False) -> Path:
    # Desirable completions end in " yes", undesirable ones in " no"; labels alternate by row.
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        good = i % 2 == 0
        answer = f"{a + b} {'yes' if good else 'no'}"
        if chat:
            rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}],
                         "completion": [{"role": "assistant", "content": answer}], "label": good})
        else:
            rows.append({"prompt": f"{a}+{b}=", "completion": answer, "label": good})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def kto_config(tmp_path: Path, chat: bool = False, **over):
    data = unpaired_file(tmp_path / "unpaired.jsonl", chat=chat)
    return dpo_config(tmp_path, **{"data.path": str(data), "dpo.loss_type": "kto", **over})


def test_stage_loss_on_unpaired_rows_matches_kto_in_fp64(tmp_path):
    """DPOStage.loss on unpaired rows (preset:tiny, fp64, live frozen copy) against KTO eq. 8 written
    out as tests/test_dpo_losses.py does: separate forwards of each sequence, z0 from the step's
    mismatched rows (prompt of row q with the completion of row q+1), clamped at 0."""
    from trainfit.train.run import build_stage

    cfg = kto_config(tmp_path, **{"model.dtype": "fp32", "dpo.beta": 0.3, "dpo.undesirable_weight": 1.5,
                                    "train.global_batch_size": 8, "train.micro_batch_size": 8})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    assert stage.unpaired and stage.sides == ["completion"]
    model = loaded.model.double()
    stage.ref_model = stage.ref_model.double()
    with torch.no_grad():   # move the policy away from its reference, so z0 > 0 is possible
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = stage.prepare(0)
    rows = batch.samples
    assert {r["desirable"] for r in rows} == {True, False}   # both branches of the loss are exercised
    ours, _ = stage.loss(model, rows, batch.totals)
    g_ours = torch.autograd.grad(ours, list(model.parameters()))

    def logp(m, prompt, answer):
        ids = torch.tensor([prompt + answer])
        lp = torch.log_softmax(m(input_ids=ids).logits[0].double(), -1)
        return sum(lp[len(prompt) + k - 1, t] for k, t in enumerate(answer))

    with torch.no_grad():
        model.eval()
        kl = [float(logp(model, r["prompt"], rows[(i + 1) % len(rows)]["completion"])
                    - logp(stage.ref_model, r["prompt"], rows[(i + 1) % len(rows)]["completion"]))
              for i, r in enumerate(rows)]
        model.train()
    z = max(0.0, sum(kl) / len(kl))
    assert batch.totals["kto_z0"] == pytest.approx(z, rel=1e-9, abs=1e-12)
    terms = []
    for r in rows:
        with torch.no_grad():
            ref = logp(stage.ref_model, r["prompt"], r["completion"])
        x = logp(model, r["prompt"], r["completion"]) - ref
        terms.append(1.0 - torch.sigmoid(0.3 * (x - z)) if r["desirable"]
                     else 1.5 * (1.0 - torch.sigmoid(0.3 * (z - x))))
    theirs = torch.stack(terms).mean()
    g_theirs = torch.autograd.grad(theirs, list(model.parameters()))
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-9)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("chat", [False, True])
def test_unpaired_rows_train_and_report_their_rewards(tmp_path, chat):
    cfg = kto_config(tmp_path, chat=chat, **{"train.max_steps": 3, "task.chat": str(chat).lower()})
    r = run_pipeline(cfg, console=QUIET)[0]
    losses = train_losses(r.stage_dir)
    assert sorted(losses) == [1, 2, 3] and losses[3] != losses[1]
    assert {"eval_desirable_reward", "eval_undesirable_reward", "eval_margin"} <= set(r.last_eval)
    assert (r.final_dir / "model.safetensors").exists()


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("case", ["not_kto", "label_text", "mixed"])
def test_unpaired_errors_name_key_value_fix_in_check_and_train(tmp_path, case):
    cfg = kto_config(tmp_path, **({"dpo.loss_type": "sigmoid"} if case == "not_kto" else {}))
    path = Path(cfg.data.path)
    rows = _rows(path)
    if case == "label_text":
        rows[5]["label"] = "yes"
    elif case == "mixed":
        rows[5] = {"prompt": "1+1=", "chosen": "2 yes", "rejected": "2 no"}
    _write(path, rows)
    words = {"not_kto": ["dpo.loss_type=sigmoid", "dpo.loss_type=kto", "unpaired"],
             "label_text": ["label='yes'", "boolean"], "mixed": ["completion", "label", "unpaired"]}[case]
    with pytest.raises(ConfigError) as e:
        check_stage(cfg)
    assert all(w in str(e.value) for w in words) and (case == "not_kto" or "line 6" in str(e.value)), str(e.value)
    # train reads the rows less the held-out split, and still names the row by its line in the file.
    (tmp_path / "c.yaml").write_text(to_yaml(cfg))
    out = CliRunner().invoke(app, ["train", str(tmp_path / "c.yaml")])
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    text = " ".join(out.output.split())
    assert all(w in text for w in words) and (case == "not_kto" or "line 6" in text), out.output


def test_plan_counts_one_sequence_a_sample_and_matches_a_real_step(tmp_path):
    from test_dpo_plan import _plan_and_real_step

    words = "one two three four five six seven eight nine ten".split()
    rows = [{"prompt": "q", "completion": ("yes " if i % 2 else "no ")
             + " ".join(random.Random(i).choices(words, k=150 if i % 2 else 20)), "label": bool(i % 2)}
            for i in range(8)]
    path = tmp_path / "long.jsonl"
    _write(path, rows)
    cfg = dpo_config(tmp_path, **{"model.name": "preset:small", "model.dtype": "fp32", "data.path": str(path),
                                  "data.max_seq_length": 128, "data.eval_fraction": 0.0, "dpo.loss_type": "kto",
                                  "train.global_batch_size": 8, "train.micro_batch_size": 4})
    p, measured, stage = _plan_and_real_step(cfg)
    assert stage.unpaired and max(len(q["prompt"]) + len(q["completion"]) for q in stage.pairs) == 128
    assert p.phases["train"].allocated / measured - 1 == pytest.approx(0.0, abs=0.10)


def test_a_dataset_of_unpaired_rows_is_recognised_with_chat_sides(tmp_path):
    from datasets import Dataset

    from trainfit.data import sources
    from trainfit.tasks.pairs import is_unpaired

    rows = [{"prompt": [{"role": "user", "content": "2+2="}], "completion": [{"role": "assistant", "content": "4"}],
             "label": True},
            {"prompt": [{"role": "user", "content": "2+3="}], "completion": [{"role": "assistant", "content": "6"}],
             "label": False}]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "u.parquet"))
    cfg = kto_config(tmp_path, **{"data.path": str(tmp_path / "u.parquet")})
    read = sources.read_rows(cfg.data, "pairs")
    assert read.shape.name == "unpaired" and [is_unpaired(read[i]) for i in range(2)] == [True, True]
    assert [read[i]["label"] for i in range(2)] == [True, False] and read[1]["completion"][0]["content"] == "6"
    assert check_stage(cfg) == []


def test_precomputed_reference_on_unpaired_rows_equals_the_live_one(tmp_path):
    runs = {}
    for pre in ("false", "true"):
        cfg = kto_config(tmp_path / pre, **{"dpo.precompute_reference": pre, "train.max_steps": 3})
        r = run_pipeline(cfg, console=QUIET)[0]
        runs[pre] = (train_losses(r.stage_dir), r.last_eval)
    assert (tmp_path / "true" / "run" / "reference_logps.pt").exists()
    live, pre = runs["false"], runs["true"]
    assert live[0][3] != live[0][1]
    for step, loss in live[0].items():
        assert pre[0][step] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert pre[1]["eval_margin"] == pytest.approx(live[1]["eval_margin"], rel=1e-5, abs=1e-7)


@pytest.mark.slow   # ~85 s on 2 busy cores; the pair rows' 2-rank kto test (tests/test_dpo.py) runs by default
def test_unpaired_rows_on_two_gloo_ranks_equal_one_rank(tmp_path):
    from test_dpo import assert_two_ranks_train_what_one_rank_trains

    cfg = kto_config(tmp_path, **{"train.max_steps": 3, "train.micro_batch_size": 2})
    assert_two_ranks_train_what_one_rank_trains(cfg, tmp_path, "distributed.strategy=ddp")


def test_paired_rows_estimate_z0_from_mismatched_chosen_and_rejected_rows(tmp_path):
    """KTO on pairs unpairs each pair into a desirable (prompt, chosen) and an undesirable (prompt,
    rejected) row, and, as TRL does, builds z0's mismatched rows from both: the prompt of step position q
    with the chosen and with the rejected answer of position q+1. The log-probs are replaced by a table
    written here, so z0 is checked against numbers worked out by hand."""
    from trainfit.train.run import build_stage

    path = tmp_path / "pairs.jsonl"
    _write(path, [{"prompt": f"{a}+{a}=", "chosen": f"{2 * a} yes", "rejected": f"{2 * a + 1} no"} for a in (1, 3)])
    cfg = dpo_config(tmp_path, **{"data.path": str(path), "data.eval_fraction": 0.0, "dpo.loss_type": "kto",
                                  "train.global_batch_size": 2, "train.micro_batch_size": 2})
    _, stage, _ = build_stage(cfg, tmp_path / "stage")
    assert not stage.unpaired
    A, B = stage.pairs[stage.order(0)], stage.pairs[stage.order(1)]   # step 0's positions 0 and 1
    key = lambda prompt, answer: (tuple(prompt), tuple(answer))   # noqa: E731

    def table(ratios):
        # policy log-prob = the log-ratio, reference = 0, per (prompt, answer) of a mismatched row.
        stage._logps = lambda model, rows, sides=None: (
            torch.tensor([ratios[key(r["prompt"], r.get("completion", r.get("chosen")))] for r in rows],
                         dtype=torch.float64),
            torch.ones(len(rows)))
        stage._reference = lambda rows, sides=None: torch.zeros(len(rows), dtype=torch.float64)
        return stage._kto_z0(0, [0, 1], 2)

    # The four mismatched rows of step 0 and their log-ratios:
    #   (prompt A, chosen B) 0.8, (prompt A, rejected B) -0.2, (prompt B, chosen A) 0.6, (prompt B, rejected A) 1.0
    # z0 = (0.8 - 0.2 + 0.6 + 1.0) / 4 = 2.2 / 4 = 0.55. (From the chosen answers only it would be 0.7.)
    ratios = {key(A["prompt"], B["chosen"]): 0.8, key(A["prompt"], B["rejected"]): -0.2,
              key(B["prompt"], A["chosen"]): 0.6, key(B["prompt"], A["rejected"]): 1.0}
    assert table(ratios) == pytest.approx(0.55)
    # Rejected answers the reference prefers pull z0 down: 0.8, -1.5, 0.6, -0.3 -> (1.4 - 1.8) / 4 = -0.1,
    # clamped at 0 (from the chosen answers only: 0.7).
    ratios.update({key(A["prompt"], B["rejected"]): -1.5, key(B["prompt"], A["rejected"]): -0.3})
    assert table(ratios) == 0.0
