"""One side (trainfit or TRL) of one benchmark repetition, in a fresh process.

    .venv/bin/python -m bench.sides trainfit SPEC.json SEED OUT.json WORKDIR
    .venv/bin/python -m bench.sides trl      SPEC.json SEED OUT.json WORKDIR

bench/run.py starts this once per side and repetition, so each side's peak RSS is its own process's
(ru_maxrss) and neither inherits the other's allocator state or warm caches.

Both sides are measured by the same instrument (`Meter`), attached from outside, not by their own
logs: the wall clock at the end of every optimizer step (after optimizer.step), and a wrapper around
the `generate` method of the model object each trainer calls, which times generation and counts the
prompt and completion tokens of every sequence (completion = up to and including the first eos). Each
side's own logs give the reward and loss per step. On CUDA every clock reading is preceded by
torch.cuda.synchronize() (kernels run asynchronously), and the peak-memory counter is reset once the
model is loaded, so `peak_cuda_mb` is torch.cuda.max_memory_allocated over the training steps
(weights included, loading transients excluded).
"""

from __future__ import annotations

import io
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from bench.workloads import Spec, trainfit_epoch_order


def rss_mb() -> float:
    """Current resident set size of this process, MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def on_cuda(spec: Spec) -> bool:
    """Whether both sides train on the GPU (device cuda, or auto with one visible)."""
    return spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def loaded_mark(spec: Spec, marks: dict) -> None:
    """After the model is loaded: RSS and CUDA memory then, and the CUDA peak counter restarted."""
    marks["rss_after_load_mb"] = rss_mb()
    if on_cuda(spec) and torch.cuda.is_initialized():
        _sync()
        marks["cuda_after_load_mb"] = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()


class Meter:
    """Per-optimizer-step wall clock and generation accounting, identical for both sides."""

    def __init__(self, steps: int):
        self.steps = steps
        self.t_begin: float | None = None
        self.ends: list[float] = []
        self.gen_s: list[float] = []
        self.gen_tokens: list[int] = []
        self.seq_tokens: list[int] = []
        self.calls = 0
        self.active = False
        self.eos: set[int] = set()
        self._gen_s, self._gen_tok, self._seq_tok = 0.0, 0, 0

    def begin(self) -> None:
        if self.t_begin is None:
            _sync()
            self.t_begin = time.perf_counter()
            self.active = True

    def end_step(self) -> None:
        if not self.active:
            return
        _sync()
        self.ends.append(time.perf_counter())
        self.gen_s.append(self._gen_s)
        self.gen_tokens.append(self._gen_tok)
        self.seq_tokens.append(self._seq_tok)
        self._gen_s, self._gen_tok, self._seq_tok = 0.0, 0, 0
        if len(self.ends) >= self.steps:
            self.active = False  # generation after the last step (a final eval) is not counted

    def _completion_len(self, row: list[int]) -> int:
        for i, t in enumerate(row):
            if t in self.eos:
                return i + 1
        return len(row)

    def _wrap(self, obj, tokens) -> None:
        """Time `obj.generate` while steps run (synchronized on CUDA); `tokens(args, kwargs, out)` gives
        (prompt tokens, completion tokens) of the call. Set as an instance attribute: it shadows the
        class's method for this object only."""
        original = obj.generate

        def generate(*args, **kwargs):
            _sync()
            t = time.perf_counter()
            out = original(*args, **kwargs)
            _sync()
            if self.active:
                self._count(time.perf_counter() - t, *tokens(args, kwargs, out))
            return out

        obj.generate = generate

    def wrap_generate(self, model, eos_ids) -> None:
        """transformers' `model.generate`: prompt (non-pad) tokens, completion tokens through the first eos."""
        self.eos = {int(e) for e in eos_ids if e is not None}

        def tokens(args, kwargs, out):
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            seqs = out if torch.is_tensor(out) else out.sequences
            new = seqs[:, ids.shape[1]:].tolist()                          # [B, <=max_new]
            return (int(mask.sum()) if mask is not None else ids.numel()), sum(self._completion_len(r) for r in new)

        self._wrap(model, tokens)

    def wrap_engine(self, engine) -> None:
        """A trainfit rollout engine (token-id prompts in, Completions out; a completion ends at its eos)."""
        self._wrap(engine, lambda args, kwargs, out: (sum(len(p) for p in kwargs.get("prompts", args[0] if args else [])),
                                                      sum(len(c.token_ids) for c in out)))

    def wrap_trl_vllm(self, generation, eos_ids) -> None:
        """TRL's colocated vLLM generation (`VLLMGeneration.generate`: token-id prompts in,
        (prompt_ids, completion_ids, ...) out), counted as `wrap_generate` counts."""
        self.eos = {int(e) for e in eos_ids if e is not None}
        self._wrap(generation, lambda args, kwargs, out: (sum(len(p) for p in out[0]),
                                                          sum(self._completion_len(list(c)) for c in out[1])))

    def _count(self, dt: float, prompt_tokens: int, completion_tokens: int) -> None:
        self._gen_s += dt
        self._gen_tok += completion_tokens
        self._seq_tok += prompt_tokens + completion_tokens
        self.calls += 1

    def step_seconds(self) -> list[float]:
        """Wall time of each optimizer step: from the previous step's end (the first: from its start)."""
        marks = [self.t_begin] + self.ends
        return [b - a for a, b in zip(marks, marks[1:])]


def _env_note() -> dict:
    return {"torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}


# ---- trainfit --------------------------------------------------------------------------------------------

def trainfit_config(spec: Spec, seed: int, run_dir: Path) -> dict:
    """The trainfit config for `spec` (everything else left at trainfit's defaults, listed in the docs)."""
    cfg = {
        "stage": spec.kind,
        "run_dir": str(run_dir),
        "model": {"name": spec.model_dir, "dtype": spec.dtype, "attn_implementation": "sdpa"},
        "peft": ({"method": "lora", "r": spec.lora_r, "alpha": spec.lora_alpha, "dropout": 0.0,
                  "target_modules": spec.lora_targets} if spec.lora_r else {"method": "none"}),
        "train": {"global_batch_size": spec.global_batch, "micro_batch_size": spec.micro_batch,
                  "max_steps": spec.steps, "lr": spec.lr, "schedule": "constant", "warmup_steps": 0,
                  "weight_decay": spec.weight_decay, "adam_beta1": spec.adam_betas[0],
                  "adam_beta2": spec.adam_betas[1], "adam_eps": spec.adam_eps, "optimizer": "adamw",
                  "grad_clip": spec.grad_clip, "seed": seed, "device": spec.device, "eval_every": 0,
                  "save_every": 0, "log_every": 1},
        # No TensorBoard, plot, progress bar or completion log: TRL runs with report_to=none and no tqdm.
        "logging": {"tensorboard": False, "progress": False, "plot": False, "save_completions": 0},
    }
    if spec.kind == "grpo":
        cfg["task"] = {**spec.task, "rewards": list(spec.rewards)}
        cfg["grpo"] = {"num_generations": spec.num_generations, "loss_type": spec.loss_type, "beta": spec.beta,
                       "epsilon": spec.epsilon, "scale_rewards": True, "num_iterations": 1}
        cfg["rollout"] = {"engine": spec.engine, "max_new_tokens": spec.max_new_tokens, "temperature": spec.temperature,
                          "top_p": 1.0, "top_k": 0, "batch_size": 0}
        if spec.engine == "vllm":  # colocated: the engine sleeps (KV cache dropped, weights to CPU) while training
            cfg["rollout"].update(gpu_memory_utilization=spec.vllm_memory, sleep_level=1)
    else:
        cfg["data"] = {"path": spec.data_path, "format": "prompt_completion", "max_seq_length": spec.seq_len,
                       "eval_fraction": 0.0}
    return cfg


def run_trainfit(spec: Spec, seed: int, work: Path, overrides: tuple = ()) -> dict:
    """`overrides` (trainfit `key=value` strings) are for what-if profiling (bench/profiling.py); the spec's
    own (`Spec.overrides`) are a variant run's (bench.run --variant)."""
    from rich.console import Console

    import trainfit.train.run as tr
    from trainfit.config import load_config
    from trainfit.train.report import read_metrics

    meter = Meter(spec.steps)
    marks: dict = {}
    run_dir = work / "trainfit-run"
    cfg = load_config(None, [*spec.overrides, *overrides], base=trainfit_config(spec, seed, run_dir))
    original_build = tr.build_stage

    def build_stage(*args, **kwargs):
        loaded, stage, device = original_build(*args, **kwargs)
        loaded_mark(spec, marks)
        if spec.kind == "grpo":
            meter.wrap_engine(stage.engine)
        prepare, summarize = stage.prepare, stage.summarize

        def timed_prepare(step):
            meter.begin()
            return prepare(step)

        def timed_summarize(*a, **k):
            out = summarize(*a, **k)  # called right after optimizer.step() and zero_grad()
            meter.end_step()
            return out

        stage.prepare, stage.summarize = timed_prepare, timed_summarize
        return loaded, stage, device

    tr.build_stage = build_stage  # run_stage looks build_stage up in its module at call time
    try:
        tr.run_pipeline(cfg, console=Console(file=io.StringIO()))
    finally:
        tr.build_stage = original_build
    rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if m.get("kind") == "train"]
    return {"meter": meter, "marks": marks,
            "loss": [r.get("loss") for r in rows], "reward": [r.get("reward") for r in rows],
            "completion_len": [r.get("completion_len") for r in rows]}


# ---- TRL -------------------------------------------------------------------------------------------------

def _trl_common(spec: Spec, seed: int, out_dir: Path) -> dict:
    return dict(
        output_dir=str(out_dir), max_steps=spec.steps, learning_rate=spec.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=spec.weight_decay, adam_beta1=spec.adam_betas[0],
        adam_beta2=spec.adam_betas[1], adam_epsilon=spec.adam_eps, max_grad_norm=spec.grad_clip,
        # torch.optim.AdamW with the fused kernel: TRL's default, and what trainfit builds.
        optim="adamw_torch_fused",
        per_device_train_batch_size=spec.micro_batch, gradient_accumulation_steps=spec.global_batch // spec.micro_batch,
        seed=seed, data_seed=seed,
        # TRL defaults these two on; trainfit trains in the model dtype without checkpointing.
        bf16=False, fp16=False, gradient_checkpointing=False,
        model_init_kwargs={"dtype": {"fp32": torch.float32, "bf16": torch.bfloat16}[spec.dtype],
                           "attn_implementation": "sdpa"},
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=not on_cuda(spec),
        dataloader_num_workers=0,
    )


def _lora(spec: Spec):
    if not spec.lora_r:
        return None
    from peft import LoraConfig

    return LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_dropout=0.0,
                      target_modules=spec.lora_targets, task_type="CAUSAL_LM")


def trl_reward_fn(spec: Spec):
    """trainfit's own reward functions (the same code trainfit's side scores with), in TRL's signature.

    The dataset carries each prompt's index in the task stream; the Example is rebuilt from it, so
    both sides score identical completions against identical answers with identical code.
    """
    from trainfit.config import TaskConfig
    from trainfit.tasks import build_task, resolve_rewards, resolve_weights, score

    tcfg = TaskConfig(**{**spec.task, "rewards": list(spec.rewards)})
    task = build_task(tcfg)
    fns, weights = resolve_rewards(tcfg, task), resolve_weights(tcfg, task)

    def reward(prompts, completions, index, **_):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        exs = [task.train_example(int(i)) for i in index]
        total, _per = score(fns, weights, [ex.prompt if ex.prompt is not None else ex.messages for ex in exs],
                            texts, exs)
        return total.tolist()

    reward.__name__ = "reward"
    return reward, task


def grpo_prompts(spec: Spec, task) -> list[dict]:
    """Prompts in trainfit's order: step r uses task examples r*P .. r*P+P-1 (TRL without shuffling)."""
    n = spec.steps * spec.prompts_per_step
    rows = []
    for i in range(n):
        ex = task.train_example(i)
        rows.append({"prompt": ex.prompt if ex.prompt is not None else ex.messages, "index": i})
    return rows


def run_trl(spec: Spec, seed: int, work: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    meter = Meter(spec.steps)
    marks: dict = {}
    logs: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            meter.begin()

        def on_step_end(self, args, state, control, **kw):  # after optimizer.step() and zero_grad()
            meter.end_step()

    tok = AutoTokenizer.from_pretrained(spec.model_dir)
    if tok.pad_token is None:  # trainfit's loader does the same
        tok.pad_token = tok.eos_token
    out_dir = work / "trl-run"
    if spec.kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        reward, task = trl_reward_fn(spec)
        args = GRPOConfig(
            **_trl_common(spec, seed, out_dir), num_generations=spec.num_generations,
            max_completion_length=spec.max_new_tokens, temperature=spec.temperature, top_p=1.0, top_k=0,
            beta=spec.beta, epsilon=spec.epsilon, loss_type=spec.loss_type, scale_rewards="group",
            num_iterations=1, shuffle_dataset=False, mask_truncated_completions=False, log_completions=False,
            **({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": spec.vllm_memory,
                "vllm_enable_sleep_mode": True} if spec.engine == "vllm" else {}))
        trainer = GRPOTrainer(model=spec.model_dir, reward_funcs=[reward], args=args,
                              train_dataset=Dataset.from_list(grpo_prompts(spec, task)), processing_class=tok,
                              peft_config=_lora(spec), callbacks=[Clock()])
        if spec.engine == "vllm":
            meter.wrap_trl_vllm(trainer.vllm_generation, trainer.eos_token_ids)
        else:
            meter.wrap_generate(trainer.model, trainer.eos_token_ids)
    else:
        from torch.utils.data import SequentialSampler
        from trl import SFTConfig, SFTTrainer

        records = [json.loads(line) for line in Path(spec.data_path).read_text().splitlines() if line.strip()]
        order = trainfit_epoch_order(len(records), seed)
        data = Dataset.from_list([records[i] for i in order])

        class InOrderSFTTrainer(SFTTrainer):
            # Feed records in trainfit's order (the file is already permuted that way), not shuffled.
            def _get_train_sampler(self, *a, **k):
                return SequentialSampler(self.train_dataset)

        args = SFTConfig(**_trl_common(spec, seed, out_dir), max_length=spec.seq_len, truncation_mode="keep_start",
                         packing=False, padding_free=False, completion_only_loss=True, shuffle_dataset=False)
        trainer = InOrderSFTTrainer(model=spec.model_dir, args=args, train_dataset=data, processing_class=tok,
                                    peft_config=_lora(spec), callbacks=[Clock()])
    loaded_mark(spec, marks)
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry and "step" in entry and "train_runtime" not in entry:
            logs.append(entry)
    return {"meter": meter, "marks": marks,
            "loss": [e.get("loss") for e in logs], "reward": [e.get("reward") for e in logs],
            "completion_len": [e.get("completions/mean_length") for e in logs]}


# ---- entry -----------------------------------------------------------------------------------------------

def summarise(spec: Spec, side: str, raw: dict, t_start: float) -> dict:
    m: Meter = raw["meter"]
    if len(m.ends) != spec.steps:
        raise RuntimeError(f"{side}: saw {len(m.ends)} optimizer steps, expected {spec.steps}")
    if spec.kind == "grpo" and m.calls == 0:
        raise RuntimeError(f"{side}: the generate wrapper saw no call; generation was not measured")
    step_s = m.step_seconds()
    if spec.kind == "sft":
        seq_tokens = [spec.global_batch * spec.seq_len] * spec.steps  # every sequence is exactly seq_len
    else:
        seq_tokens = m.seq_tokens
    out = {
        "side": side,
        "step_s": step_s,
        "gen_s": m.gen_s,
        "gen_tokens": m.gen_tokens,
        "train_tokens": seq_tokens,
        "loss": raw["loss"],
        "reward": raw["reward"],
        "completion_len": raw["completion_len"],
        "peak_rss_mb": peak_rss_mb(),
        "rss_after_load_mb": raw["marks"].get("rss_after_load_mb"),
        "setup_s": (m.t_begin or time.perf_counter()) - t_start,
        **_env_note(),
    }
    if on_cuda(spec):
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["cuda_after_load_mb"] = raw["marks"].get("cuda_after_load_mb")
        out["gpu_name"] = torch.cuda.get_device_name()
    return out


def main(argv: list[str]) -> None:
    t_start = time.perf_counter()
    side, spec_path, seed, out_path, work = argv
    threads = int(os.environ.get("BENCH_THREADS", "0")) or os.cpu_count() or 1
    torch.set_num_threads(threads)
    spec = Spec.from_json(json.loads(Path(spec_path).read_text()))
    work_dir = Path(work)
    work_dir.mkdir(parents=True, exist_ok=True)
    runner = {"trainfit": run_trainfit, "trl": run_trl}[side]
    raw = runner(spec, int(seed), work_dir)
    Path(out_path).write_text(json.dumps(summarise(spec, side, raw, t_start)))


if __name__ == "__main__":
    main(sys.argv[1:])
