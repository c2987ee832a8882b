"""Request bodies and response shapes of the OpenAI-compatible API (with vLLM's extensions).

Unknown fields are accepted and ignored, as vLLM does, so clients written for OpenAI or vLLM work
unchanged; fields that change the meaning of a request and are not implemented (streaming, echo) are
rejected with a 400 instead of being silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from trainfit.app.serve.limits import error_body
from trainfit.rollout.base import Completion


class APIError(Exception):
    """An error the client should see, as OpenAI's {"error": {...}} body with this HTTP status (plus
    `extra` fields in it, and `headers` such as Retry-After)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 headers: Optional[dict] = None, **extra):
        super().__init__(message)
        self.status, self.message, self.type, self.headers, self.extra = status, message, type_, headers, extra

    def body(self) -> dict:
        return error_body(self.status, self.message, self.type, **self.extra)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = Field(None, description="Base model name or a loaded adapter's name.")
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off (vLLM uses -1).")
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    n: int = Field(1, ge=1, le=256)
    stream: bool = False
    include_stop_str_in_output: bool = False      # vLLM extension
    return_tokens_as_token_ids: bool = False      # vLLM extension: tokens as "token_id:123"
    skip_special_tokens: bool = True              # vLLM extension

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty.")
        return stops


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class LoadAdapterRequest(BaseModel):
    lora_name: str = Field(..., min_length=1)
    lora_path: str = Field(..., min_length=1)
    load_inplace: bool = False


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str = Field(..., min_length=1)


def message_text(message: dict[str, Any]) -> dict[str, str]:
    """A chat message with its content as one string (OpenAI allows a list of text parts)."""
    role, content = message.get("role"), message.get("content", "")
    if not isinstance(role, str):
        raise APIError(400, "every message needs a string `role`.")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise APIError(400, "only text content parts are supported (no images or audio).")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if not isinstance(content, str):
        raise APIError(400, "message content must be a string or a list of text parts.")
    return {"role": role, "content": content}


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """OpenAI semantics: the returned text ends before the first stop string."""
    cuts = [text.find(s) for s in stops if s in text]
    return text[:min(cuts)] if cuts else text


def finish_reason(c: Completion) -> str:
    return "stop" if c.finished else "length"


def token_strings(tokenizer, ids: list[int], as_ids: bool) -> list[str]:
    return [f"token_id:{t}" if as_ids else tokenizer.decode([t]) for t in ids]


def completion_logprobs(tokenizer, c: Completion, as_ids: bool) -> dict:
    """vLLM's completions `logprobs`: the sampled token's log-prob per token (no alternatives)."""
    tokens = token_strings(tokenizer, c.token_ids, as_ids)
    lps = list(c.logprobs or [])
    offsets, pos = [], 0
    for t in (tokenizer.decode([i]) for i in c.token_ids):
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)]}


def chat_logprobs(tokenizer, c: Completion, as_ids: bool) -> dict:
    tokens = token_strings(tokenizer, c.token_ids, as_ids)
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, c.logprobs or [])]}


def envelope(kind: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
