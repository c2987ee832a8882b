"""The HTTP routes of `trainfit serve`: OpenAI-compatible completions and chat, plus vLLM's adapter routes.

    GET  /health                      200 when the model is loaded (no API key needed), with the queue:
                                      sequences in it now, the most so far, its limit, requests refused
    GET  /v1/models                   the base model, then every loaded adapter (`parent` = the base)
    POST /v1/completions              prompt: text, token ids, or a list of either
    POST /v1/chat/completions         messages through the tokenizer's chat template (or vLLM's request
                                      `chat_template` / `add_generation_prompt`); for a vision-language
                                      model, image parts (base64 `image_url` data URLs or `image`)
    POST /v1/load_lora_adapter        {"lora_name": ..., "lora_path": ...}, as vLLM
    POST /v1/unload_lora_adapter      {"lora_name": ...}

A request's `model` selects an adapter by name; the base model's name (or no `model`) selects the base
with adapters disabled. Log-probs are log softmax(logits / T) of the sampled token (T = 1 for greedy),
the values the trainer computes; alternatives (top_logprobs beyond the sampled token) are not returned.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from contextlib import asynccontextmanager
from typing import Awaitable, Callable, Optional

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from trainfit.rollout.base import Completion
from trainfit.app.serve.batcher import Batcher, Overloaded
from trainfit.app.serve.guard import BodyGuard
from trainfit.app.serve.limits import ServeLimits
from trainfit.app.serve.policy import SamplingKey, ServedPolicy
from trainfit.app.serve.protocol import (APIError, ChatRequest, CompletionRequest, LoadAdapterRequest,
                                     UnloadAdapterRequest, chat_logprobs, completion_logprobs, cut_at_stop,
                                     envelope, finish_reason, message_text)
from trainfit.rollout.image_chat import chat_images, has_image_parts
from trainfit.data.image_parts import expand

DEFAULT_MAX_TOKENS = 16   # OpenAI's and vLLM's default for /v1/completions
_entropy = random.SystemRandom()


def request_seeds(seed: Optional[int], n: int) -> list[int]:
    """One seed per choice: the request's seed for the first, derived ones for the rest, random without."""
    if seed is None:
        return [_entropy.getrandbits(62) for _ in range(n)]
    # String seeding is hashed with SHA-512: the same derived seeds in every process.
    return [seed % 2**63] + [random.Random(f"{seed}:{i}").getrandbits(62) for i in range(1, n)]


def create_app(policy: ServedPolicy, *, max_batch: int = 32, batch_wait_ms: float = 10.0,
               api_key: Optional[str] = None, limits: ServeLimits = ServeLimits()) -> FastAPI:
    """The app serving `policy`: requests batched by a Batcher (up to `max_batch` sequences, waiting
    `batch_wait_ms` for more, at most `limits.max_queue` queued: 503 past it), bodies read whole within
    `limits` (guard.py), the /v1 routes behind `api_key` when one is given."""
    batcher = Batcher(lambda key, prompts, seeds: policy.generate(key, prompts, seeds, batch_size=max_batch),
                      max_batch=max_batch, wait_ms=batch_wait_ms, max_queue=limits.max_queue)
    app = FastAPI(title="trainfit serve", lifespan=_closing(batcher))
    app.state.policy, app.state.batcher, app.state.limits = policy, batcher, limits
    created = int(time.time())
    app.add_middleware(BodyGuard, limits=limits)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _bad_body)
    app.add_exception_handler(HTTPException, _http_error)      # unknown route, wrong method: JSON too
    app.add_exception_handler(Exception, _server_error)

    @app.get("/health")
    async def health_route():
        return health(batcher)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_key_check(api_key))])
    _add_routes(v1, _Requests(policy, batcher), created)
    app.include_router(v1)
    return app


def _closing(batcher: Batcher):
    """The app's lifespan: the batcher's thread stops when the app shuts down."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        batcher.close()
    return lifespan


async def _api_error(request: Request, exc: APIError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException):
    what = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", what).body(),
                        status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception):
    return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(),
                        status_code=500)


async def _bad_body(request: Request, exc: RequestValidationError):
    parts = ["the body is not valid JSON" if e["type"] == "json_invalid" else
             f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()]
    return JSONResponse(APIError(400, "invalid request: " + "; ".join(parts)).body(), status_code=400)


def _key_check(api_key: Optional[str]):
    """The /v1 routes' dependency: with `api_key`, a request must send it as a bearer token."""
    def check_key(authorization: Optional[str] = Header(None)) -> None:
        if api_key is None:
            return
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key: send the header `Authorization: Bearer <key>`.",
                           "authentication_error")
    return check_key


def health(batcher: Batcher) -> dict:
    return {"status": "ok", "queue": {"depth": batcher.depth, "max_depth": batcher.max_depth,
                                      "limit": batcher.max_queue, "refused": batcher.refused}}


def _add_routes(v1: APIRouter, r: "_Requests", created: int) -> None:
    """The /v1 routes, each answered by `r`."""
    @v1.get("/models")
    async def models():
        return r.models(created)

    @v1.post("/completions")
    async def completions(req: CompletionRequest):
        return await r.completions(req)

    @v1.post("/chat/completions")
    async def chat(req: ChatRequest):
        return await r.chat(req)

    @v1.post("/load_lora_adapter")
    def load_lora_adapter(req: LoadAdapterRequest):
        return r.load_adapter(req)

    @v1.post("/unload_lora_adapter")
    def unload_lora_adapter(req: UnloadAdapterRequest):
        return r.unload_adapter(req)


class _Requests:
    """What the routes do with a request, on the served policy and its batcher."""

    def __init__(self, policy: ServedPolicy, batcher: Batcher):
        self.policy, self.batcher = policy, batcher

    def models(self, created: int) -> dict:
        policy = self.policy

        def card(name, root, parent):
            return {"id": name, "object": "model", "created": created, "owned_by": "trainfit", "root": root,
                    "parent": parent, "max_model_len": policy.max_model_len or None}
        data = [card(policy.name, policy.source, None)]
        data += [card(n, p, policy.name) for n, p in list(policy.adapters.items())]
        return {"object": "list", "data": data}

    def adapter_of(self, model: Optional[str]) -> Optional[str]:
        try:
            return self.policy.resolve(model)
        except KeyError:
            raise APIError(404, f"The model `{model}` does not exist; GET /v1/models lists the base model "
                                "and the loaded adapters.", "NotFoundError") from None

    def check_prompt(self, ids: list[int], max_tokens: int) -> None:
        policy = self.policy
        if not ids:
            raise APIError(400, "the prompt is empty.")
        vocab = len(policy.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of the vocabulary (0..{vocab - 1}).")
        if policy.max_model_len and len(ids) + max_tokens > policy.max_model_len:
            raise APIError(400, f"This model's maximum context length is {policy.max_model_len} tokens; the "
                                f"request has {len(ids)} prompt tokens and asks for {max_tokens} more. "
                                "Shorten the prompt or lower max_tokens.")

    @staticmethod
    def sampling_key(req, adapter: Optional[str], max_tokens: int) -> SamplingKey:
        """How `req` samples (requests with equal keys share a generate call); streaming is refused."""
        if req.stream:
            raise APIError(400, "stream=true is not supported by trainfit serve; send stream=false.")
        return SamplingKey(adapter, max_tokens, req.temperature, req.top_p, max(req.top_k, 0), req.stops())

    async def generated(self, req, start: Callable[[], Awaitable[list[Completion]]]) -> list[Completion]:
        """The completions of the generation `start()` begins, its failures (starting included) as API errors."""
        try:
            return await start()
        except Overloaded as e:   # the queue is full: the client should come back, not wait here
            raise APIError(503, str(e), "server_overloaded", headers={"Retry-After": str(e.retry_after_s)},
                           retry_after=e.retry_after_s) from None
        except KeyError:  # the adapter was unloaded while the request waited
            self.adapter_of(req.model)
            raise
        except Exception as e:
            raise APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error") from e

    async def run(self, req, adapter: Optional[str], prompts: list[list[int]], max_tokens: int) -> list[Completion]:
        """`req.n` completions of every prompt, batched with other requests."""
        key = self.sampling_key(req, adapter, max_tokens)
        self.check_size(len(prompts) * req.n)
        seqs = [p for p in prompts for _ in range(req.n)]
        seeds = [s for _ in prompts for s in request_seeds(req.seed, req.n)]
        return await self.generated(req, lambda: asyncio.wrap_future(self.batcher.submit(key, seqs, seeds)))

    def text_of(self, req, c: Completion) -> str:
        text = c.text if req.skip_special_tokens else self.policy.tokenizer.decode(c.token_ids)
        return text if req.include_stop_str_in_output else cut_at_stop(text, req.stops())

    async def completions(self, req: CompletionRequest) -> dict:
        adapter = self.adapter_of(req.model)
        if req.echo:
            raise APIError(400, "echo=true is not supported by trainfit serve.")
        raw = req.prompt
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise APIError(400, "the prompt is empty.")
        tok = self.policy.tokenizer
        prompts = [tok(p)["input_ids"] if isinstance(p, str) else list(p) for p in raw]
        max_tokens = req.max_tokens or DEFAULT_MAX_TOKENS
        for p in prompts:
            self.check_prompt(p, max_tokens)
        outs = await self.run(req, adapter, prompts, max_tokens)
        want_ids = bool((req.model_extra or {}).get("return_token_ids"))
        choices = []
        for k, c in enumerate(outs):
            choice = {"index": k, "text": self.text_of(req, c), "finish_reason": finish_reason(c),
                      "logprobs": None if req.logprobs is None
                      else completion_logprobs(tok, c, req.return_tokens_as_token_ids)}
            if want_ids:
                choice |= {"token_ids": c.token_ids, "prompt_token_ids": prompts[k // req.n]}
            choices.append(choice)
        return envelope("text_completion", req.model or self.policy.name, choices, sum(map(len, prompts)),
                        sum(len(c.token_ids) for c in outs))

    async def chat(self, req: ChatRequest) -> dict:
        adapter = self.adapter_of(req.model)
        prompt, images = self.chat_prompt(req)
        max_tokens = (req.max_completion_tokens or req.max_tokens
                      or max(1, (self.policy.max_model_len or 0) - len(prompt)))
        self.check_prompt(prompt, max_tokens)
        if images:  # not batched with other requests: one generate call with the images
            outs = await self.generate_with_images(req, adapter, prompt, images, max_tokens)
        else:
            outs = await self.run(req, adapter, [prompt], max_tokens)
        tok = self.policy.tokenizer
        choices = [{"index": k, "message": {"role": "assistant", "content": self.text_of(req, c)},
                    "logprobs": chat_logprobs(tok, c, req.return_tokens_as_token_ids) if req.logprobs else None,
                    "finish_reason": finish_reason(c)} for k, c in enumerate(outs)]
        return envelope("chat.completion", req.model or self.policy.name, choices, len(prompt),
                        sum(len(c.token_ids) for c in outs))

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], list]:
        """The prompt's token ids through the chat template, and its images (for a vision-language model)."""
        policy, tok = self.policy, self.policy.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions.")
        extra, images = req.model_extra or {}, []
        if policy.processor is not None and has_image_parts(req.messages):   # rollout/image_chat.py
            try:
                messages, images = chat_images(req.messages, policy.processor)
            except ValueError as e:
                raise APIError(400, str(e)) from None
        else:
            messages = [message_text(m) for m in req.messages]
        try:
            text = tok.apply_chat_template(messages, tokenize=False, chat_template=extra.get("chat_template"),
                                           add_generation_prompt=bool(extra.get("add_generation_prompt", True)))
        except Exception as e:  # a template that rejects the conversation (roles, order)
            raise APIError(400, f"the chat template rejected the messages: {e}") from None
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        if images:  # each image's pad token repeated to its token count
            try:
                prompt = expand(prompt, images, policy.processor)
            except Exception as e:
                raise APIError(400, f"the images do not match the rendered prompt: {e}") from None
        return prompt, images

    async def generate_with_images(self, req: ChatRequest, adapter: Optional[str], prompt: list[int], images: list,
                                   max_tokens: int) -> list[Completion]:
        """`req.n` completions of one prompt with images: one generate call of its own, not batched."""
        key = self.sampling_key(req, adapter, max_tokens)
        self.check_size(req.n)

        async def start() -> list[Completion]:
            self.batcher.admit(req.n)       # counted in the queue's bound like batched requests
            try:
                return await asyncio.to_thread(self.policy.generate, key, [prompt] * req.n,
                                               request_seeds(req.seed, req.n), images=[images] * req.n)
            finally:
                self.batcher.done(req.n)
        return await self.generated(req, start)

    def check_size(self, sequences: int) -> None:
        """A request larger than the whole queue could never be admitted: 400, not 503."""
        if sequences > self.batcher.max_queue:
            raise APIError(400, f"the request asks for {sequences} sequences (prompts x n), more than the server "
                                f"queues at once ({self.batcher.max_queue}, --max-queue); split it.")

    def load_adapter(self, req: LoadAdapterRequest):
        try:
            self.policy.load_adapter(req.lora_name, req.lora_path, replace=req.load_inplace)
        except (ValueError, FileNotFoundError) as e:
            raise APIError(400, str(e)) from None
        except Exception as e:  # peft could not attach it (other architecture, corrupt file)
            raise APIError(400, f"could not load the LoRA adapter at {req.lora_path!r}: {type(e).__name__}: {e}") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    def unload_adapter(self, req: UnloadAdapterRequest):
        try:
            self.policy.unload_adapter(req.lora_name)
        except KeyError:
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
