"""Rollouts from any OpenAI-compatible server: `vllm serve --enable-lora`, SGLang, `trainfit serve`.

    rollout: {engine: openai, base_url: http://127.0.0.1:8000/v1}

The server holds its own copy of the base weights; the trainer trains a LoRA/DoRA adapter and, before
every rollout round, `sync` writes it to `rollout.sync_dir/v{n}` and asks the server to load it under
a new name (`trainfit-v{n}`) through vLLM's /v1/load_lora_adapter; later requests name that adapter.
The sync directory must be visible to the server at the same path (same machine or a shared disk).
For `vllm serve`, set VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, pass --enable-lora with --max-lora-rank >=
peft.r, and --logprobs-mode processed_logprobs so log-probs are at the sampling temperature.

A request the server does not answer for good (dead, hanging, 408/429/5xx) is retried with backoff within
rollout.retry_max_s (trainfit/core/retry.py); each carries its prompt's seed, so a retried request is the
same sample and a group is never mixed from two attempts. A server that restarted and lost the synced
adapter (404 for its name) gets it loaded again from sync_dir, and the request is sent again.

Each prompt is one /v1/completions request with token ids in and token ids out (vLLM's
`return_tokens_as_token_ids`), its own seed, and the sampled token's log-prob; requests are sent
concurrently and the server batches them. A prompt with images (vision-language policies) goes to
/v1/chat/completions instead, its images as OpenAI `image_url` content parts (trainfit/rollout/image_chat.py).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import httpx

from trainfit.config import ConfigError, RolloutConfig
from trainfit.core.retry import GaveUp, RetryPolicy, send
from trainfit.data.image_examples import vision_token_ids
from trainfit.models.policy import unwrap
from trainfit.rollout.base import Completion, EngineError
from trainfit.rollout.image_chat import VERBATIM_TEMPLATE, image_prompt_parts

log = logging.getLogger(__name__)


def _parse_token(tok: str) -> int:
    if not tok.startswith("token_id:"):
        raise EngineError(f"the server returned token {tok!r}, not 'token_id:N': it ignores "
                          "return_tokens_as_token_ids (use vLLM, SGLang or trainfit serve).")
    return int(tok.split(":", 1)[1])


class _AdapterMissing(EngineError):
    """The server answered 404 for the synced adapter's name: it restarted and lost it."""


class OpenAIEngine:
    name = "openai"
    shares_weights = False

    def __init__(self, cfg: RolloutConfig, tokenizer, stop: Sequence[str] = (), workdir: Optional[Path] = None):
        if not cfg.base_url:
            raise ConfigError("rollout.engine=openai needs rollout.base_url, the server's OpenAI-compatible URL "
                              "such as http://127.0.0.1:8000/v1 (`trainfit serve MODEL` or `vllm serve MODEL "
                              "--enable-lora`).")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.stop = list(dict.fromkeys([*cfg.stop, *stop]))
        self.processor = None   # a vision.images.VisionProcessor for a VLM policy (set by the stage)
        self.base_url = cfg.base_url.rstrip("/")
        # /health lives at the server's root, beside /v1 (vLLM, SGLang, trainfit serve).
        self.root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.workers = max(1, min(cfg.batch_size or 64, 256))
        self.client = httpx.Client(headers=headers, timeout=cfg.request_timeout_s,
                                   limits=httpx.Limits(max_connections=self.workers))
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="trainfit-openai")
        self.retry = RetryPolicy(cfg.request_timeout_s, cfg.request_retries, cfg.retry_backoff_s,
                                 max(cfg.retry_max_s, cfg.request_timeout_s))
        self.reload_lock = threading.Lock()   # one reload of a lost adapter, however many requests saw it lost
        self.adapter_path: Optional[Path] = None
        self.sync_dir = Path(cfg.sync_dir) if cfg.sync_dir else (Path(workdir) / "rollout_sync" if workdir else None)
        self.version = 0
        self.adapter: Optional[str] = None       # the synced adapter's name at the server, once synced
        # Appended to the adapters' names and directories: several engines of one run share a server (the
        # rollout.mode=async worker's beside the trainer's, which evaluates) and must not unload each other's.
        self.tag = ""
        self.wait_healthy(cfg.health_timeout_s)
        names = self.models()
        if not names or (cfg.served_model and cfg.served_model not in names):
            raise EngineError(f"{self.base_url}/models lists {names or 'no model'}; set rollout.served_model to "
                              "the base model's name there.")
        self.base_model = cfg.served_model or names[0]
        self.model_name = self.base_model       # what requests name: the base, then the latest adapter

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll {root}/health (then {base_url}/models) until the server answers 200."""
        deadline, last = time.monotonic() + timeout_s, "no answer"
        while True:
            for url in (f"{self.root}/health", f"{self.base_url}/models"):
                try:
                    r = self.client.get(url, timeout=max(0.5, min(5.0, deadline - time.monotonic())))
                    if r.status_code == 200:
                        return
                    last = f"GET {url} -> HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    last = f"GET {url} -> {type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"the OpenAI-compatible server at {self.base_url} did not become healthy within {timeout_s:g}s "
                    f"(last: {last}). Start it first (`trainfit serve MODEL --port N`, or `vllm serve MODEL "
                    "--enable-lora`), check rollout.base_url, or raise rollout.health_timeout_s.")
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def _request(self, method: str, path: str, root: bool = False, **kw) -> httpx.Response:
        url = f"{self.root if root else self.base_url}{path}"

        def read(r: httpx.Response) -> httpx.Response:
            if r.status_code == 200:
                return r
            model = (kw.get("json") or {}).get("model")
            if r.status_code == 404 and model is not None and model == self.adapter:
                raise _AdapterMissing(f"{method} {url} -> HTTP 404: {r.text[:300]}")
            hint = " (is rollout.api_key_env set to the server's key?)" if r.status_code == 401 else ""
            raise EngineError(f"{method} {url} -> HTTP {r.status_code}{hint}: {r.text[:500]}")

        try:
            return send(self.client, method, url, self.retry, read=read, **kw)
        except GaveUp as e:
            p = self.retry
            why = "failed" if e.state == "failing" else "stopped answering"
            raise EngineError(
                f"the OpenAI-compatible server at {url} {e.state}: {e.tried()}. Check that it is running at "
                f"rollout.base_url (its log says why it {why}), or allow a longer restart than these settings wait "
                f"out ({p.outage_s():.0f} s at least) with rollout.request_retries and rollout.retry_max_s "
                f"(rollout.request_retries={p.retries}, request_timeout_s={p.timeout_s:g}, "
                f"retry_max_s={p.max_s:g}).") from None

    def _generation(self, path: str, body: dict) -> dict:
        """POST a generation request; when a restarted server lost the synced adapter, load it again first."""
        try:
            return self._request("POST", path, json=body).json()
        except _AdapterMissing:
            self._reload_adapter(body["model"])
            return self._request("POST", path, json=body).json()

    def _reload_adapter(self, name: str) -> None:
        with self.reload_lock:
            if name in self.models():   # another request's reload came first
                return
            log.warning("the server at %s lost the adapter %s (restarted?): loading it again from %s",
                        self.base_url, name, self.adapter_path)
            self._adapter_call("/load_lora_adapter", {"lora_name": name, "lora_path": str(self.adapter_path.resolve())})

    def models(self) -> list[str]:
        return [m["id"] for m in self._request("GET", "/models").json().get("data", [])]

    def generate(self, prompts: list[list[int]], *, greedy: bool = False, seeds: Optional[Sequence[int]] = None,
                 max_new_tokens: Optional[int] = None, batch_size: Optional[int] = None,
                 logprobs: bool = False, temperature: Optional[float] = None,
                 images: Optional[Sequence[list]] = None) -> list[Completion]:
        temp = 0.0 if greedy else (self.cfg.temperature if temperature is None else temperature)
        if seeds is None:  # per-prompt seeds still, so no two prompts share a server-side default
            seeds = [random.getrandbits(62) for _ in prompts]
        body = {"model": self.model_name, "max_tokens": max_new_tokens or self.cfg.max_new_tokens,
                "temperature": temp, "logprobs": 0, "return_tokens_as_token_ids": True,
                "include_stop_str_in_output": True, "skip_special_tokens": True}
        if self.cfg.top_p < 1.0:
            body["top_p"] = self.cfg.top_p
        if self.cfg.top_k:
            body["top_k"] = self.cfg.top_k
        if self.stop:
            body["stop"] = self.stop
        if self.processor is not None:  # a vision-language policy never samples vision tokens
            body["logit_bias"] = {str(i): -100 for i in vision_token_ids(self.processor)}
        images = list(images) if images is not None else [None] * len(prompts)
        jobs = [self.pool.submit(self._complete_chat, body, list(p), ims, int(s)) if ims else
                self.pool.submit(self._complete, {**body, "prompt": list(p), "seed": int(s)})
                for p, s, ims in zip(prompts, seeds, images)]
        outs = [j.result() for j in jobs]
        if not logprobs:
            for c in outs:
                c.logprobs = None
        return outs

    def _complete(self, body: dict) -> Completion:
        choice = self._generation("/completions", body)["choices"][0]
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:
            ids = [_parse_token(t) for t in lp.get("tokens") or []]
        values = lp.get("token_logprobs")
        if values is None or len(values) != len(ids):
            raise EngineError(f"{self.base_url}/completions returned {0 if values is None else len(values)} "
                              f"log-probs for {len(ids)} tokens; the server must honour `logprobs`.")
        return Completion(list(ids), self.tokenizer.decode(ids, skip_special_tokens=True),
                          choice.get("finish_reason") == "stop", [float(v) for v in values])

    def _complete_chat(self, body: dict, prompt: list[int], images: list, seed: int) -> Completion:
        """A prompt with images: one user message of text and image_url parts, rendered verbatim by
        the server (rollout/image_chat.py), token ids and log-probs back from the chat logprobs."""
        req = {k: v for k, v in body.items() if k != "logprobs"}
        req.update(messages=[{"role": "user", "content": image_prompt_parts(self.tokenizer, prompt, images)}],
                   chat_template=VERBATIM_TEMPLATE, add_generation_prompt=False, logprobs=True, seed=seed)
        choice = self._generation("/chat/completions", req)["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        ids = choice.get("token_ids") or [_parse_token(c["token"]) for c in content]
        if len(content) != len(ids):
            raise EngineError(f"{self.base_url}/chat/completions returned {len(content)} log-probs for {len(ids)} "
                              "tokens; the server must honour `logprobs`.")
        return Completion(list(ids), self.tokenizer.decode(ids, skip_special_tokens=True),
                          choice.get("finish_reason") == "stop", [float(c["logprob"]) for c in content])

    def sync(self, model) -> None:
        """Push the trainer's adapter: save it to sync_dir/v{n}, load it as a new name, unload the old."""
        model = unwrap(model)
        if not hasattr(model, "peft_config"):
            raise EngineError("rollout.engine=openai syncs LoRA/DoRA adapters only (the server keeps its own base "
                              "weights), but this model is trained in full. Set peft.method=lora, or use "
                              "rollout.engine=vllm (colocated, syncs full weights) or rollout.engine=hf.")
        if self.sync_dir is None:
            raise EngineError("rollout.engine=openai needs a directory to write adapters to: set rollout.sync_dir "
                              "(visible to the server at the same path).")
        self.version += 1
        rank = _rank_suffix() + self.tag
        name, path = f"trainfit{rank}-v{self.version}", self.sync_dir / f"v{self.version}{rank}"
        tmp = path.with_name(f".tmp-{path.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(tmp))  # adapter_config.json + adapter_model.safetensors, nothing else
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)  # the server never sees a half-written adapter
        self._adapter_call("/load_lora_adapter", {"lora_name": name, "lora_path": str(path.resolve())})
        if name not in self.models():
            raise EngineError(f"{self.base_url} accepted the adapter {name!r} but does not list it in /models.")
        previous, self.adapter, self.model_name, self.adapter_path = self.adapter, name, name, path
        if previous is not None:
            try:
                self._adapter_call("/unload_lora_adapter", {"lora_name": previous})
            except EngineError as e:  # the new adapter is live; a leftover old one only costs server memory
                if "HTTP 404" not in str(e):   # 404: a restarted server no longer holds it, nothing to unload
                    log.warning("could not unload the previous adapter %s: %s", previous, e)
            shutil.rmtree(self.sync_dir / f"v{self.version - 1}{rank}", ignore_errors=True)

    def _adapter_call(self, path: str, body: dict) -> None:
        """vLLM and trainfit serve take adapter calls under /v1, SGLang at the root: try both."""
        try:
            self._request("POST", path, json=body)
        except EngineError as e:
            if "HTTP 404" not in str(e) or "lora adapter" in str(e).lower():
                raise
            self._request("POST", path, root=True, json=body)

    # The server is remote: its memory is not the trainer's to release.
    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _rank_suffix() -> str:
    """Several trainer ranks share one server: give each rank's adapters distinct names."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"-r{dist.get_rank()}"
    return ""
