"""The layouts users keep their data in, built here as small JSON, JSONL and parquet files, each read by the
stage that reads it; the test checks the decoded text the stage trains on (and which of it carries loss), not
only that it ran: alpaca, ShareGPT, hh-rlhf, HuggingFaceH4's UltraFeedback (with and without `messages`),
TRL prompt/completion, messages, conversational and unpaired (KTO) pairs, and verl (its prompt as a list, or as
JSON text)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_config
from datasource_helpers import write
from trainfit.data.text import IGNORE, encode_prompt
from trainfit.tasks import build_task
from trainfit.tasks.pairs import PairRows, encode_policy_rows, is_unpaired

MSG = lambda role, text: {"role": role, "content": text}  # noqa: E731
S, E = "<|im_start|>", "<|im_end|>"
CHAT = lambda *turns: "".join(f"{S}{r}\n{t}{E}\n" for r, t in turns)  # noqa: E731  the test tokenizer's template
FORMATS = ("json", "jsonl", "parquet")


def _h4(i: int, messages: bool) -> dict:
    """A row of HuggingFaceH4/ultrafeedback_binarized (train_prefs)."""
    q = f"What is {i}+1?"
    row = {"prompt": q, "prompt_id": f"id{i}", "chosen": [MSG("user", q), MSG("assistant", f"It is {i + 1}.")],
           "rejected": [MSG("user", q), MSG("assistant", f"It is {i + 7}.")], "score_chosen": 9.0, "score_rejected": 2.0}
    if messages:
        row["messages"] = row["chosen"]
    return row


def _verl(i: int, as_json: bool) -> dict:
    prompt = [MSG("user", f"What is {i}+{i}?")]
    return {"data_source": "openai/gsm8k", "prompt": json.dumps(prompt) if as_json else prompt, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}


# layout: (rows, {stage: (what the stage trains on for row 0, as decoded text)})
# sft: (the whole sequence, the tokens with loss); rm: (chosen sequence, rejected sequence);
# dpo: (prompt, chosen answer's trained tokens, rejected answer's trained tokens); grpo: (prompt, answer).
LAYOUTS = {
    "alpaca": ([{"instruction": f"Double {i}.", "input": f"({i})", "output": str(2 * i)} for i in range(8)],
               {"sft": ("Double 0.\n(0)0" + E, "0" + E),
                "grpo": (CHAT(("user", "Double 0.\n(0)")) + f"{S}assistant\n", "0")}),
    "alpaca_system": ([{"instruction": f"Double {i}.", "input": "", "output": str(2 * i), "system": "Be brief."}
                       for i in range(8)],
                      {"sft": (CHAT(("system", "Be brief."), ("user", "Double 0."), ("assistant", "0")), "0" + E)}),
    "sharegpt": ([{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}],
                   "system": "Be brief."} for i in range(8)],
                 {"sft": (CHAT(("system", "Be brief."), ("user", "q0"), ("assistant", "a0")), "a0" + E)}),
    "trl_prompt_completion": ([{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(8)],
                              {"sft": ("0+0=0" + E, "0" + E)}),
    "trl_messages": ([{"messages": [MSG("user", f"hi {i}"), MSG("assistant", f"hello {i}")]} for i in range(8)],
                     {"sft": (CHAT(("user", "hi 0"), ("assistant", "hello 0")), "hello 0" + E)}),
    "trl_pairs": ([{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(8)],
                  {"rm": ("0+1=1" + E, "0+1=2" + E), "dpo": ("0+1=", "1" + E, "2" + E)}),
    "trl_chat_pairs": ([{"prompt": [MSG("user", f"{i}+1?")], "chosen": [MSG("assistant", str(i + 1))],
                         "rejected": [MSG("assistant", str(i + 2))]} for i in range(8)],
                       {"rm": (CHAT(("user", "0+1?"), ("assistant", "1")), CHAT(("user", "0+1?"), ("assistant", "2"))),
                        "dpo": (CHAT(("user", "0+1?")) + f"{S}assistant\n", "1" + E, "2" + E)}),
    # Anthropic hh-rlhf: no prompt column; each side is the whole dialogue, the prompt their common start.
    "hh_rlhf": ([{"chosen": f"\n\nHuman: What is {i}+1?\n\nAssistant: It is {i + 1}.",
                  "rejected": f"\n\nHuman: What is {i}+1?\n\nAssistant: It is {i + 7}."} for i in range(8)],
                {"rm": ("\n\nHuman: What is 0+1?\n\nAssistant: It is 1." + E,
                        "\n\nHuman: What is 0+1?\n\nAssistant: It is 7." + E),
                 "dpo": ("\n\nHuman: What is 0+1?\n\nAssistant: It is", " 1." + E, " 7." + E)}),
    "h4_ultrafeedback": ([_h4(i, True) for i in range(8)],
                         {"sft": (CHAT(("user", "What is 0+1?"), ("assistant", "It is 1.")), "It is 1." + E),
                          "rm": (CHAT(("user", "What is 0+1?"), ("assistant", "It is 1.")),
                                 CHAT(("user", "What is 0+1?"), ("assistant", "It is 7."))),
                          "dpo": (CHAT(("user", "What is 0+1?")) + f"{S}assistant\n", "It is 1." + E, "It is 7." + E)}),
    "h4_without_messages": ([_h4(i, False) for i in range(8)],
                            {"rm": (CHAT(("user", "What is 0+1?"), ("assistant", "It is 1.")),
                                    CHAT(("user", "What is 0+1?"), ("assistant", "It is 7."))),
                             "dpo": (CHAT(("user", "What is 0+1?")) + f"{S}assistant\n", "It is 1." + E, "It is 7." + E)}),
    # TRL's unpaired preference rows (KTO): one answer and its label.
    "trl_unpaired": ([{"prompt": f"{i}+1=", "completion": str(i + 1), "label": i % 2 == 0} for i in range(8)],
                     {"dpo": ("0+1=", "1" + E)}),
    "verl": ([_verl(i, False) for i in range(8)],
             {"grpo": (CHAT(("user", "What is 0+0?")) + f"{S}assistant\n", "0")}),
    "verl_prompt_as_json_text": ([_verl(i, True) for i in range(8)],
                                 {"grpo": (CHAT(("user", "What is 0+0?")) + f"{S}assistant\n", "0")}),
}
CASES = [(name, stage, fmt) for name, (_, stages) in LAYOUTS.items() for stage in stages for fmt in FORMATS]


pytestmark = pytest.mark.usefixtures("datasets_cache")


def _config(tmp_path, stage: str, path: str):
    if stage == "grpo":
        return tiny_config(tmp_path, stage, **{"task.name": "dataset", "task.path": path, "task.num_eval": 2,
                                               "task.chat": True})
    kto = {"dpo.loss_type": "kto"} if "unpaired" in path else {}
    return tiny_config(tmp_path, stage, **{"data.path": path, "task.name": "null", "data.max_seq_length": 96,
                                           "data.eval_fraction": 0.0, **kto})


def trained_text(tok, stage: str, cfg, model=None) -> tuple:
    """What `stage` trains on for the first row, decoded (see LAYOUTS)."""
    dec = tok.decode
    if stage == "sft":
        from trainfit.train.sft import LMStage

        item = LMStage(cfg, model, tok, torch.device("cpu")).train_items[0]
        return dec(item["input_ids"]), dec([t for t, lab in zip(item["input_ids"], item["labels"]) if lab != IGNORE])
    if stage == "rm":
        from trainfit.train.rm import RMStage

        pair = RMStage(cfg, None, tok, torch.device("cpu")).pairs[0]
        return dec(pair["chosen"]), dec(pair["rejected"])
    if stage == "dpo":
        rows = PairRows(cfg).train()
        loss = "kto" if is_unpaired(rows[0]) else "sigmoid"
        p = encode_policy_rows(rows, tok, cfg.data.max_seq_length, cfg.task.chat, loss)[0][0]
        kept = lambda side: dec([t for t, m in zip(p[side], p[side + "_mask"]) if m])  # noqa: E731
        sides = ("completion",) if loss == "kto" else ("chosen", "rejected")
        return (dec(p["prompt"]), *map(kept, sides))
    task = build_task(cfg.task)
    ex = next(task.train_example(i) for i in range(task.num_train) if task.train_example(i).answer == "0")
    return dec(encode_prompt(tok, ex, cfg.task.chat)), ex.answer


@pytest.mark.parametrize("name, stage, fmt", CASES)
def test_a_layout_trains_on_the_right_text(tmp_path, tiny_lm, name, stage, fmt):
    rows, stages = LAYOUTS[name]
    cfg = _config(tmp_path, stage, write(rows, fmt, tmp_path / name))
    from trainfit.train.datacheck import check_stage

    assert check_stage(cfg) == []   # the pre-run check accepts what the stage reads
    assert trained_text(tiny_lm[1], stage, cfg, tiny_lm[0]) == stages[stage]
