"""Writes examples/data/agent_tools_sft.jsonl: expert tool-use conversations for the SFT stage of
examples/agent_tools.yaml, one per training problem of its arithmetic task (held-out problems never):

    user: 37*58=   assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "37*58"}}</tool_call>
    tool: 2146     assistant: 2146

The system message is the tools block the chat template writes when an episode passes `tools=` (the
calculator's schema), so an SFT row renders to the same tokens as an episode of the GRPO stage.

    python examples/data/make_agent_tools_sft.py        # from the repository root
"""

from __future__ import annotations

import json
from pathlib import Path

from trainfit.config import load_config
from trainfit.envs.tools import calculator, tool_schema
from trainfit.models.tokenizer import build_tokenizer
from trainfit.tasks import build_task

ROOT = Path(__file__).resolve().parents[2]
ROWS = 512


def tools_system_text() -> str:
    """The text of the system turn the presets' chat template writes for the calculator's schema."""
    text = build_tokenizer().apply_chat_template([{"role": "user", "content": "x"}], tools=[tool_schema(calculator)],
                                                 tokenize=False)
    start, end = "<|im_start|>system\n", "<|im_end|>"
    return text[text.index(start) + len(start):text.index(end)]


def main() -> None:
    cfg = load_config(ROOT / "examples" / "agent_tools.yaml")
    task = build_task(cfg.task)   # the pipeline's task, shared by both stages
    system = tools_system_text()
    out = ROOT / "examples" / "data" / "agent_tools_sft.jsonl"
    with out.open("w") as f:
        for i in range(ROWS):
            ex = task.train_example(i)
            expr = ex.fields["expression"]
            call = {"name": "calculator", "arguments": {"expression": expr}}
            f.write(json.dumps({"messages": [
                {"role": "system", "content": system},
                *ex.messages,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": calculator(expr)},
                {"role": "assistant", "content": ex.answer}]}) + "\n")
    print(f"wrote {ROWS} rows to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
