"""Architecture facts: the shipped catalog, name resolution, and parameter counts on the meta device."""

import json
import os
import tempfile

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-plan-test-"))

import pytest

from trainfit.config import ConfigError
from trainfit.models.shapes import arch_facts, locate, match_targets
from trainfit.models.catalog import catalog_entries, catalog_lookup

# Published parameter counts (model cards / safetensors metadata).
PUBLISHED = {
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "meta-llama/Llama-3.2-1B": 1_235_814_400,
    "meta-llama/Llama-3.1-70B": 70_553_706_496,
    "Qwen/Qwen3-8B": 8_190_735_360,
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,
    "HuggingFaceTB/SmolLM2-135M": 134_515_008,
    "Qwen/Qwen2.5-7B": 7_615_616_512,
    "google/gemma-2-2b": 2_614_341_888,
}


def test_catalog_covers_the_popular_architectures():
    entries = catalog_entries()
    assert len(entries) >= 20
    for name in ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B", "Qwen/Qwen3-14B",
                 "Qwen/Qwen3-32B", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-14B", "Qwen/Qwen2.5-72B",
                 "Qwen/Qwen3-VL-8B-Instruct", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B",
                 "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B", "mistralai/Mistral-7B-v0.1",
                 "google/gemma-2-2b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "HuggingFaceTB/SmolLM2-135M",
                 "HuggingFaceTB/SmolLM2-1.7B", "state-spaces/mamba-2.8b-hf"]:
        assert catalog_lookup(name) is not None, name
    for entry in entries.values():  # architecture numbers only: no weights, small files
        assert "config" in entry and "model_type" in entry["config"]


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_meta_device_counts_equal_published(name, count):
    assert arch_facts(name).n_params == count


def test_every_catalog_count_matches_its_recorded_count():
    for stem, entry in catalog_entries().items():
        if entry.get("published_params"):
            assert arch_facts(entry["names"][0]).n_params == entry["published_params"], stem


def test_names_resolve_without_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert locate("Qwen/Qwen3-8B").kind == "catalog"
    assert catalog_lookup("qwen3-8b") == catalog_lookup("Qwen/Qwen3-8B-Instruct") == "qwen3-8b"
    assert catalog_lookup("meta-llama/Llama-3.1-8B-Instruct") == "llama-3.1-8b"
    with pytest.raises(ConfigError, match="catalog"):
        locate("nobody/not-a-model-7b")


def test_local_directory_with_config_json(tmp_path):
    cfg = dict(catalog_entries()["smollm2-135m"]["config"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    src = locate(str(tmp_path))
    assert src.kind == "local"
    assert arch_facts(src).n_params == 134_515_008


def test_facts_of_special_architectures():
    llama = arch_facts("meta-llama/Llama-3.1-8B")
    assert llama.kv_full_per_token == 2 * 32 * 8 * 128  # 2 x layers x kv_heads x head_dim
    assert not llama.tied and llama.n_lm_head == 128256 * 4096
    small = arch_facts("meta-llama/Llama-3.2-1B")
    assert small.tied and small.n_lm_head == 0
    vl = arch_facts("Qwen/Qwen3-VL-8B-Instruct")
    assert vl.n_vision > 0.5e9 and vl.n_params == vl.published_params
    moe = arch_facts("Qwen/Qwen3-30B-A3B")
    assert moe.num_experts == 128 and 2.5e9 < moe.n_active_params < 3.5e9
    mamba = arch_facts("state-spaces/mamba-2.8b-hf")
    assert mamba.kv_full_per_token == 0 and mamba.ssm_state_per_seq == 64 * 5120 * (4 + 16)
    mistral = arch_facts("mistralai/Mistral-7B-v0.1")
    assert mistral.sliding_window == 4096 and mistral.kv_elems(8192, 1) == mistral.kv_elems(4096, 1)
    gemma = arch_facts("google/gemma-2-2b")
    assert gemma.kv_full_per_token == gemma.kv_window_per_token  # alternating full / sliding layers


def test_lora_targets_follow_peft_rules():
    f = arch_facts("meta-llama/Llama-3.1-8B")
    assert {g.name.split(".")[-1] for g in match_targets(f, "all-linear")} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # lm_head excluded
    assert [g.name.split(".")[-1] for g in match_targets(f, ["q_proj", "v_proj"])] == ["q_proj", "v_proj"]


def test_gpu_catalog_names_and_nvml_detection(monkeypatch):
    import sys
    import types

    from trainfit.plan import hardware

    assert hardware.find_gpu("NVIDIA H100 80GB HBM3").key == "h100-80gb"
    assert hardware.find_gpu("NVIDIA A100-SXM4-40GB").key == "a100-40gb"
    assert hardware.find_gpu("h200").memory > 140e9 and hardware.find_gpu("48GB").memory == 48e9
    with pytest.raises(ValueError, match="unknown GPU"):
        hardware.find_gpu("tpu-v9")
    mem = types.SimpleNamespace(total=81559 * 2**20, free=60 * 2**30, used=81559 * 2**20 - 60 * 2**30)
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlSystemGetDriverVersion=lambda: b"550.54",
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMemoryInfo=lambda h: mem)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    found = hardware.detect()
    assert len(found) == 2 and found[0].key == "h100-80gb" and found[0].free == 60 * 2**30 and found[0].detected
    gpu, how = hardware.resolve_gpu(None)
    assert gpu.key == "h100-80gb" and how == "detected (NVML)"
