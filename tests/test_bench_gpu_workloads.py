"""The GPU benchmark workloads (grpo-gpu-0.5b, sft-gpu-1.7b) keep working without a GPU or TRL.

Their `--quick` version (the same catalog architecture family at toy shapes, the local tokenizer, no
GGUF, 1 step, CPU) goes Spec -> prepare -> trainfit side -> figures -> results JSON here, in-process
and without TRL (the `bench` extra is not installed by `make test`); tests/test_bench_harness.py runs
both sides when TRL is there. The FLOP/MFU arithmetic and the goal checks are tested on their own.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

from bench import run as bench_run  # noqa: E402
from bench.flops import attention, model_facts, run_mfu, step_flops  # noqa: E402
from bench.sides import run_trainfit, summarise  # noqa: E402
from bench.workloads import WORKLOADS, distinct_chars, prepare, quick  # noqa: E402

# The CUDA workloads `bench.run gpu` runs (the vLLM variant needs vllm and is run by name).
GPU = [n for n, s in WORKLOADS.items() if s.device == "cuda" and s.engine == "hf"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_gpu_workloads_are_listed():
    assert {"grpo-gpu-0.5b", "sft-gpu-1.7b"} <= set(GPU)


@pytest.mark.parametrize("name", ["grpo-gpu-0.5b", "sft-gpu-1.7b"])
def test_quick_gpu_workload_trainfit_side(name, tmp_path):
    """Spec -> model dir -> trainfit on CPU -> per-run figures -> a results JSON with ratios left empty."""
    from transformers import AutoConfig

    from trainfit.models.catalog import catalog_entries

    base = WORKLOADS[name]
    # Fewer samples than the workload's (GRPO: 16 completions, not 128) to stay fast; gradient
    # accumulation (2 micro-batches) is kept.
    micro = min(base.micro_batch, 8)
    spec = quick(dataclasses.replace(base, global_batch=2 * micro, micro_batch=micro))
    assert spec.device == "cpu" and spec.shrink and spec.steps == 1
    spec = prepare(spec, tmp_path)
    stem = base.model.split(":", 1)[1]
    catalog = catalog_entries()[stem]["config"]
    cfg = AutoConfig.from_pretrained(spec.model_dir)
    assert cfg.model_type == catalog["model_type"] and cfg.vocab_size == 512  # local tokenizer
    # Grouped-query attention stays grouped (Qwen2.5), plain multi-head stays plain (SmolLM2).
    grouped = catalog["num_key_value_heads"] < catalog["num_attention_heads"]
    assert (cfg.num_key_value_heads < cfg.num_attention_heads) == grouped

    raw = run_trainfit(spec, spec.seed, tmp_path / "tf")
    r = summarise(spec, "trainfit", raw, t_start=0.0)
    assert len(r["step_s"]) == 1 and r["step_s"][0] > 0 and r["loss"][0] is not None
    assert "peak_cuda_mb" not in r  # device cpu: RSS is the memory figure
    facts = model_facts(spec.model_dir)
    r["figures"] = bench_run.per_run_figures(r, spec, facts)
    f = r["figures"]
    assert f["steps_per_s"] == pytest.approx(1 / r["step_s"][0])
    assert f["tokens_per_s"] == pytest.approx((r["gen_tokens"][0] + r["train_tokens"][0]) / r["step_s"][0])
    assert f["mfu"] is None  # no GPU, no peak to divide by
    if spec.kind == "grpo":
        assert r["gen_tokens"][0] > 0 and r["reward"][0] is not None
    else:
        assert r["train_tokens"][0] == spec.global_batch * spec.seq_len
    for k in ("rep", "seed", "quiet", "contended", "others_cores", "loadavg_before"):
        r.setdefault(k, 0 if k != "loadavg_before" else [0.0])
    args = SimpleNamespace(max_load=0.0, max_wait=0.0, max_others=0.0)
    result = bench_run.summarise(spec, [r], args, facts)
    assert set(result["sides"]) == {"trainfit"}
    assert result["ratio"]["steps_per_s_trainfit_over_trl"] is None
    assert all(v is None for k, v in result["goal"].items() if k.endswith("_met"))
    json.dumps(result)  # what run.main writes


def test_step_flops_formula():
    facts = {"matmul_params": 1000, "layers": 2, "heads": 4, "head_dim": 8}
    assert attention(facts, 10) == 2 * 2 * 4 * 8 * 100
    sft = step_flops("sft", False, facts, train_tokens=40, sequences=4)    # 4 sequences of 10
    assert sft["total"] == 6 * 1000 * 40 + 3 * 4 * attention(facts, 10) and sft["generate"] == 0
    grpo = step_flops("grpo", True, facts, train_tokens=40, sequences=4)
    assert grpo["train"] == 4 * 1000 * 40 + 3 * 4 * attention(facts, 10)
    assert grpo["generate"] == 2 * 1000 * 40 + 4 * attention(facts, 10)


def test_mfu_on_a_catalogued_gpu():
    """MFU uses the steps after the first and the H100's dense bf16 peak (989 TFLOP/s in the catalog)."""
    spec = dataclasses.replace(WORKLOADS["sft-gpu-1.7b"], global_batch=2, seq_len=4)
    facts = {"matmul_params": 10**9, "layers": 1, "heads": 1, "head_dim": 1}
    run = {"step_s": [9.0, 2.0, 2.0], "gen_s": [0.0] * 3, "train_tokens": [8] * 3, "gpu_name": "NVIDIA H100 80GB HBM3"}
    per_step = 6 * 10**9 * 8 + 3 * 2 * attention(facts, 4)
    out = run_mfu(spec, facts, run)
    assert out["mfu"] == pytest.approx(2 * per_step / 4.0 / 989e12)
    assert run_mfu(spec, facts, {**run, "gpu_name": None})["mfu"] is None


def test_model_facts_untied(tmp_path):
    """An untied LM head is its own weight: the input embedding is the only one left out."""
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, tie_word_embeddings=False).save_pretrained(tmp_path)
    f = model_facts(str(tmp_path))
    assert f["matmul_params"] == f["params"] - 100 * 16 and not f["tied_embeddings"]


def test_goals():
    spec = WORKLOADS["grpo-gpu-0.5b"]
    g = bench_run.goals(spec, speedup=2.5, memory=0.9, mfu=None)
    assert g["speedup_met"] is True and g["memory_met"] is False and g["mfu_target"] is None
    g = bench_run.goals(WORKLOADS["sft-gpu-1.7b"], speedup=None, memory=None, mfu=0.5)
    assert g["mfu_met"] is True and g["speedup_met"] is None


def test_distinct_chars_reward():
    assert distinct_chars([], ["aaaa", "abcd", ""]) == [0.25, 1.0, 0.0]


def test_gpu_workloads_refuse_cpu_only_machines(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="need a CUDA GPU"):
        bench_run.main(["gpu", "--sides", "trainfit"])


@pytest.mark.slow
def test_runner_quick_gpu_workloads(tmp_path):
    """`python -m bench.run gpu --quick`: both GPU workloads through the runner (subprocess per side)."""
    import importlib.util

    sides = "trainfit,trl" if importlib.util.find_spec("trl") else "trainfit"
    md = tmp_path / "BENCHMARKS.md"
    bench_run.main(["gpu", "--quick", "--sides", sides, "--max-load", "0", "--max-others", "0",
                    "--out-dir", str(tmp_path / "results"), "--md", str(md), "--work", str(tmp_path / "work")])
    for name in GPU:
        r = json.loads((tmp_path / "results" / f"{name}.json").read_text())
        assert set(r["sides"]) == set(sides.split(","))
        assert r["sides"]["trainfit"]["steps_per_s"]["median"] > 0
        assert r["measurement"]["model_facts"]["layers"] == 2
    text = md.read_text()
    assert "## GPU workloads" in text and "| grpo-gpu-0.5b | trainfit |" in text


def test_meter_counts_each_generate_flavour():
    """The meter's wrappers (transformers generate, a trainfit engine, TRL's vLLM generation) count
    prompt tokens and completion tokens through the first eos, only while steps run."""
    import torch

    from bench.sides import Meter
    from trainfit.rollout.base import Completion

    class HF:
        def generate(self, input_ids=None, attention_mask=None, **kw):   # 2 new tokens a row
            return torch.cat([input_ids, torch.tensor([[7, 2], [2, 9]])], dim=1)

    class Engine:
        def generate(self, prompts, **kw):
            return [Completion([5, 6, 2], "x", True) for _ in prompts]

    class VLLM:
        def generate(self, prompts, images, num_generations, profiler=None):
            return prompts, [[4, 2, 0], [4, 4, 4]], None, None

    m = Meter(steps=1)
    hf, eng, vl = HF(), Engine(), VLLM()
    m.wrap_generate(hf, eos_ids=[2])
    m.wrap_engine(eng)
    m.wrap_trl_vllm(vl, eos_ids=[2])
    ids, mask = torch.tensor([[1, 1, 3], [0, 3, 3]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    hf.generate(input_ids=ids, attention_mask=mask)            # not counted: no step has begun
    m.begin()
    hf.generate(input_ids=ids, attention_mask=mask)            # prompts 3 + 2, completions 2 + 1
    eng.generate([[1, 2, 3], [4]])                              # prompts 4, completions 3 + 3
    vl.generate([[1, 1], [1]], None, 1)                         # prompts 3, completions 2 + 3
    m.end_step()
    assert m.calls == 3 and m.gen_tokens == [3 + 6 + 5] and m.seq_tokens == [5 + 3 + 4 + 6 + 3 + 5]
    assert m.gen_s[0] > 0
