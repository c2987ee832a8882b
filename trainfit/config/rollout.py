"""Config sections for generation: the rollout engine and the multi-turn environment.

Part of the one schema in trainfit.config (which re-exports these); cross-field rules that involve
them are `rollout_errors` there.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from trainfit.config.base import _Section

# The retry waits of the remote parts (trainfit/core/retry.py): the first is backoff_s, each next twice
# the last, none over RETRY_MAX_WAIT_S, each shortened by up to RETRY_JITTER of itself at random.
RETRY_MAX_WAIT_S = 30.0
RETRY_JITTER = 0.5


def outage_s(retries: int, backoff_s: float, max_s: float) -> float:
    """The longest outage a request's retries surely wait out: its waits at their shortest, within max_s."""
    waits = sum((1 - RETRY_JITTER) * min(backoff_s * 2 ** k, RETRY_MAX_WAIT_S) for k in range(retries))
    return min(max_s, waits)


class RolloutConfig(_Section):
    engine: Literal["hf", "vllm", "openai"] = Field("hf", description="Generation engine (hf = in-process transformers).")
    max_new_tokens: int = Field(64, ge=1, description="Tokens generated per completion at most.")
    max_prompt_length: int = Field(512, ge=1, description=(
        "Prompt tokens at most (longer prompts keep their last tokens); GRPO training sequences are "
        "max_prompt_length + max_new_tokens at most."))
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor-parallel GPUs (weights and KV cache split over them).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    stop: list[str] = Field(default_factory=list, description="Stop strings that end a completion (kept in the text).")
    batch_size: int = Field(0, ge=0, description="Sequences generated together (0 = the whole rollout batch).")
    decoder: Literal["auto", "trainfit", "generate"] = Field("auto", description=(
        "hf: the decoding loop. `trainfit` = trainfit's KV-cached loop (one prefill per distinct prompt, "
        "finished completions leave the batch); `generate` = transformers' generate with the same sampling; "
        "`auto` = trainfit's loop for the models it covers (standard decoder-only transformers), else generate."))
    merge_lora: Literal["auto", "always", "never"] = Field("auto", description=(
        "hf: decode with LoRA merged into temporary weights (the trained base is restored bit for bit). "
        "`auto` = when the weights are in CPU memory and the call decodes 32+ steps (on CPU the merge pays "
        "for itself; on GPU the unmerged adapters cost little)."))
    hf_cache: Literal["auto", "dynamic", "static"] = Field("auto", description=(
        "hf, trainfit's decoding loop: the KV cache. `static` = one cache preallocated at rows x (prompt + "
        "max_new_tokens), written in place, finished rows kept in the batch (fed padding) so every step has "
        "one shape; `dynamic` = a cache that grows each step, finished rows leave the batch; `auto` = static "
        "on CUDA, dynamic on CPU. Sliding-window models and flash-attention keep the dynamic cache."))
    hf_cuda_graphs: bool = Field(True, description=(
        "hf with the static cache on CUDA: compile the one-token decode step with "
        "torch.compile(mode='reduce-overhead') (a CUDA graph per batch-size bucket, powers of two from 8). "
        "The caches are then kept on the card between rollouts (one per bucket) so the graphs replay."))
    gpu_memory_utilization: float = Field(0.5, gt=0.0, lt=1.0, description="vLLM: share of the card the engine takes.")
    sleep_level: Literal[0, 1, 2] = Field(1, description=(
        "vLLM sleep between phases: 0 none; 1 drops the KV cache and moves weights to CPU RAM; 2 drops both. "
        "Not used by rollout.mode=async, whose worker samples while the trainer trains (the engine stays awake)."))
    base_url: Optional[str] = Field(None, description=(
        "openai: the server's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (`trainfit serve`, "
        "`vllm serve --enable-lora`, SGLang)."))
    api_key_env: str = Field("OPENAI_API_KEY", description="openai: environment variable holding the server's API key (unset = none).")
    served_model: Optional[str] = Field(None, description="openai: the base model's name at the server (default: the first of /v1/models).")
    health_timeout_s: float = Field(120.0, gt=0, description="openai: seconds to wait for the server's /health at start.")
    request_timeout_s: float = Field(600.0, gt=0, description="openai: seconds one generation request may take.")
    request_retries: int = Field(10, ge=0, description=(
        "openai: retries of a request the server did not answer for good (connection refused or reset, no reply "
        "within request_timeout_s, 408/429/5xx); each completion has its own seed, so a retried one is the same sample."))
    retry_backoff_s: float = Field(1.0, ge=0, description=(
        "openai: first retry delay; doubles each retry (at most 30 s, less up to half at random), at least the "
        "server's Retry-After."))
    retry_max_s: float = Field(900.0, gt=0, description=(
        "openai: seconds one request's attempts and waits take together at most (how long a restarting server "
        "may stay away); then the step stops with the URL and what was tried."))
    sync_dir: Optional[str] = Field(None, description=(
        "openai / vllm: directory the trainer writes adapters to for the engine to load; it must be visible "
        "to the server at the same path (default: <stage dir>/rollout_sync)."))
    sync_check: Literal["auto", "always", "never"] = Field("auto", description=(
        "After each weight sync, compare the engine's log-probs with the trainer's on a fixed probe batch "
        "and stop on a mismatch. `auto` = for engines that hold their own copy of the weights (vllm, openai, and "
        "the rollout.mode=async worker's copy)."))
    sync_tolerance: float = Field(0.05, gt=0, description=(
        "Largest mean |engine log-prob - trainer log-prob| per probe token the sync check accepts "
        "(bf16 engines differ from the trainer by ~0.01)."))
    sync_probe_prompts: int = Field(4, ge=1, description="Prompts in the sync check's probe batch (each completed to 16 tokens).")
    mode: Literal["sync", "async"] = Field("sync", description=(
        "`sync`: generate, score, train, generate, in turn. `async`: a rollout worker (a thread or a child process, rollout.worker) "
        "generates and scores the next rollouts on its own copy of the trained weights while the trainer trains; each "
        "sample carries the policy version it was sampled with (rollouts consumed: version r is the weights at "
        "rollout r's first optimizer step, so with grpo.num_iterations=1 the optimizer steps done), and rollout "
        "r is sampled by version max(0, r - max_staleness). The weights are pushed to the worker once a rollout. "
        "With grpo.num_iterations > 1 the PPO ratios are against the trainer's weights at the rollout's first "
        "step, and off_policy reweights by those over the sampler's. A checkpoint keeps the rollouts sampled "
        "ahead (waiting for the worker to finish them), so `--resume` continues with the policy versions and "
        "samples of an uninterrupted run. Stage grpo, one training process (trainfit/train/async_rollout.py). Engine "
        "hf: the worker samples from its copy, on the trainer's device or on a GPU of its own with "
        "distributed.rollout_gpus. Engine openai: the worker pushes each version's adapter to the server (named "
        "trainfit-async-v<n>, beside the trainer's own for evaluations) and the server samples."))
    worker: Literal["thread", "process"] = Field("thread", description=(
        "async: where the rollout worker runs. `thread` = a thread of the training process (on the CPU it "
        "shares the GIL with the trainer; use it on a GPU and where the worker mostly waits on an environment); "
        "`process` = a child process on the CPU (train.device=cpu; the trainer's weights on a GPU are refused), "
        "which rebuilds the stage from the config, shares the frozen tensors with the trainer through shared "
        "memory, keeps its own copy of the trainable ones, takes each push through a shared-memory buffer, "
        "and gets half of train.cpu_threads (at least 1 each) so trainer and worker run in parallel; the same "
        "versions, samples and guarantees as `thread` (trainfit/train/async_process.py)."))
    max_staleness: int = Field(1, ge=0, description=(
        "async: policy versions (rollouts consumed) a trained sample may lag the trainer at most (k). The "
        "worker waits for the "
        "weights rather than drop samples; at most k rollouts wait in its queue. 0 = never stale: the same "
        "samples, metrics and weights as `sync`."))
    off_policy: Literal["tis", "decoupled", "none"] = Field("tis", description=(
        "async: correction of stale samples, per policy token, with w = pi_prox / pi_behav (pi_prox = the "
        "trainer's policy at the start of the rollout's first step, pi_behav = the version that sampled): "
        "`tis` = truncated importance sampling, w clipped at importance_cap (verl); `decoupled` = AReaL's "
        "decoupled PPO, tokens "
        "with w over importance_cap left out; `none` = stale samples trained as if on-policy. A sample of the "
        "trainer's own version has w = 1 exactly (trainfit/algos/offpolicy.py)."))
    importance_cap: float = Field(2.0, ge=1.0, description=(
        "async: C of rollout.off_policy, the largest behaviour importance weight kept (tis truncates to C, "
        "decoupled drops tokens above C)."))
    max_turns: int = Field(1, ge=1, description="Policy turns per episode at most (multi-turn needs `env`).")
    max_episode_tokens: int = Field(0, ge=0, description=(
        "Tokens per episode at most, prompt, policy and environment together (0 = max_prompt_length + "
        "max_turns x (max_new_tokens + env.max_observation_tokens)). An episode that reaches it ends."))
    max_images_per_episode: int = Field(0, ge=0, description=(
        "Images (environment screenshots) kept in one episode's context at most, for vision-language "
        "policies (0 = no limit). Past it the oldest image's tokens are removed from the sequence, oldest "
        "first; the policy's turns that saw a dropped image are trained as a row of their own with the context "
        "they were sampled in (trainfit/envs/episodes.py); transcripts count the drops as info.images_dropped."))
    fit_min_images_per_episode: int = Field(1, ge=1, description=(
        "`trainfit fit --allow-screens`: the fewest screenshots an episode may keep when fit lowers "
        "max_images_per_episode to fit the card (it never goes below; at or above the kept screenshots = fit "
        "keeps them all). Read only by fit: training keeps max_images_per_episode."))


    def outage_s(self) -> float:
        """openai: the longest server outage (a restart) the request retries surely wait out."""
        return outage_s(self.request_retries, self.retry_backoff_s, self.retry_max_s)

class EnvConfig(_Section):
    type: Literal["none", "tools", "simulated_user", "http"] = Field("none", description=(
        "Multi-turn environment for GRPO: `tools` (the model calls Python functions), `simulated_user` "
        "(a model plays the user), `http` (a remote environment service); `none` = single-turn task."))
    tools: list[str] = Field(default_factory=list, description=(
        "tools: Python functions the model may call, as `module:function` or `path/file.py:function` "
        "(typed arguments and a docstring; the schema is built from them). Empty = the built-in calculator."))
    domains: list[str] = Field(default_factory=list, description=(
        "simulated_user: domains to draw tasks from (the `domain` field of task rows); empty = all."))
    tasks_per_domain: int = Field(0, ge=0, description="simulated_user: tasks sampled per domain (0 = all).")
    user_model: Optional[str] = Field(None, description=(
        "simulated_user: model that plays the user; none = the policy's own loaded weights with adapters "
        "disabled (one copy in memory)."))
    user_max_new_tokens: int = Field(64, ge=1, description="simulated_user: tokens per user turn at most.")
    user_temperature: float = Field(0.7, ge=0.0, description="simulated_user: the user's sampling temperature.")
    max_observation_tokens: int = Field(256, ge=1, description="Tokens of one environment reply kept at most (longer replies are cut).")
    url: Optional[str] = Field(None, description="http: the environment service's base URL (POST {url}/reset and {url}/step).")
    api_key_env: str = Field("TRAINFIT_ENV_API_KEY", description="http: environment variable with the service's API key (sent as a Bearer token).")
    timeout_s: float = Field(30.0, gt=0, description="http: seconds one request may take.")
    retries: int = Field(8, ge=0, description=(
        "http: retries of a request the service did not answer for good (connection refused or reset, no "
        "reply within timeout_s, 408/429/5xx, a reply that is not the protocol's JSON)."))
    backoff_s: float = Field(0.5, ge=0, description=(
        "http: first retry delay; doubles each retry (at most 30 s, less up to half at random), at least the "
        "service's Retry-After."))
    retry_max_s: float = Field(120.0, gt=0, description=(
        "http: seconds one request's attempts and waits take together at most (how long a restarting service "
        "may stay away); then the episode is lost and its group sampled again."))
    group_retries: int = Field(2, ge=0, description=(
        "http: times a GRPO group is sampled again, whole and with the same seeds, when the service lost one "
        "of its episodes (it restarted) or stayed unreachable past retry_max_s; then the run stops naming the "
        "URL (a group never trains on part of its episodes). A held-out evaluation episode lost that way is "
        "played again as often, never counted as the policy's failure."))

    def outage_s(self) -> float:
        """http: the longest service outage (a restart) the request retries surely wait out."""
        return outage_s(self.retries, self.backoff_s, self.retry_max_s)
