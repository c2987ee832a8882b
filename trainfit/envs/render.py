"""Chat-template token deltas: what a new message adds to a conversation, as token ids.

An episode's tokens are never re-rendered: the policy's turns are kept exactly as sampled, and each
environment reply is appended as the template's rendering of [conversation + new messages] minus the
rendering of [conversation]. A fixed dummy conversation stands in for the real one, which is valid
when the template is prefix-stable (rendering more messages only appends text). Templates that
rewrite earlier turns once more follow (Qwen3 drops an empty think block from past assistant turns)
are handled by anchoring on the dummy assistant turn's end instead; a template where neither works
is a ConfigError naming the problem.
"""

from __future__ import annotations

from typing import Optional

from trainfit.config import ConfigError

from .base import EnvError

DUMMY = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]


class ChatRenderer:
    """Token ids of prompts, end-of-turn closes and observations under one (tokenizer, tools) pair."""

    def __init__(self, tokenizer, tools: Optional[list[dict]] = None):
        self.tok, self.tools = tokenizer, tools or None
        reply = DUMMY[1]["content"]
        pre = self.text(DUMMY[:1], True)
        self.dummy_text = self.text(DUMMY, False)
        at = self.dummy_text.find(reply, len(pre)) if self.dummy_text.startswith(pre) else -1
        if at < 0:
            raise ConfigError(
                "The chat template is not prefix-stable: rendering [user, assistant] does not extend the "
                "rendering of [user] with the generation prompt, so the policy's turns cannot be appended "
                "token by token. Use a template whose assistant turns follow its generation prompt.")
        # What the template writes after an assistant message's content: the end-of-turn token(s).
        self.close_text = self.dummy_text[at + len(reply):]
        self.close_ids = self.ids(self.close_text)
        self.anchor = reply + self.close_text
        self.dummy_ids = self.ids(self.dummy_text)
        self.gen_prompt_ids = self.observation_ids([])  # probes the template once; raises if unusable

    def text(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def ids(self, text: str) -> list[int]:
        # The template writes its own special tokens; the tokenizer must not add a BOS again.
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        try:
            return self.ids(self.text(messages, True))
        except Exception as e:
            raise EnvError(f"the chat template failed on the opening messages (roles "
                           f"{[m.get('role') for m in messages]}): {e}") from None

    def close_after(self, completion_ids: list[int]) -> list[int]:
        """End-of-turn ids to append after a policy turn so the next message renders as in a full
        conversation; the first one is skipped when the completion already ends with it (eos)."""
        c = self.close_ids
        if c and completion_ids and completion_ids[-1] == c[0]:
            return c[1:]
        return list(c)

    def observation_ids(self, messages: list[dict]) -> list[int]:
        """Ids the template adds for `messages` after an assistant turn, through the generation prompt."""
        try:
            full = self.text(DUMMY + list(messages), True)
        except Exception as e:
            raise EnvError(f"the chat template failed on the environment's messages (roles "
                           f"{[m.get('role') for m in messages]}): {e}") from None
        if full.startswith(self.dummy_text):
            ids = self.ids(full)
            if ids[:len(self.dummy_ids)] == self.dummy_ids:
                return ids[len(self.dummy_ids):]
            # A BPE merge across the boundary: tokenize the new text alone (it starts a new message).
            return self.ids(full[len(self.dummy_text):])
        at = full.find(self.anchor, full.find(DUMMY[0]["content"]))
        if at < 0:
            raise ConfigError(
                "The chat template is not prefix-stable: rendering a conversation plus new messages neither "
                "extends the conversation's own rendering nor keeps an earlier assistant turn's ending "
                f"({self.close_text!r}), so environment replies cannot be appended as token deltas. Use a "
                "template that renders past turns the same way whatever follows them.")
        return self.ids(full[at + len(self.anchor):])

    def fit_observation(self, messages: list[dict], limit: int) -> tuple[list[int], list[dict], bool]:
        """(ids, messages as the model sees them, truncated) with at most `limit` ids.

        Cutting the ids would drop the end-of-turn and generation-prompt tokens, so message contents
        are cut instead (earlier messages kept first) and the messages rendered again.
        """
        ids = self.observation_ids(messages)
        if len(ids) <= limit:
            return ids, list(messages), False
        overhead = len(self.observation_ids([dict(m, content="") for m in messages]))
        if overhead >= limit:
            raise EnvError(f"env.max_observation_tokens={limit} cannot hold even the template's headers of "
                           f"this reply ({overhead} tokens for {len(messages)} messages); raise it.")
        contents = [self.ids(m["content"]) for m in messages]
        budget = limit - overhead
        for _ in range(8):  # re-tokenizing cut text can merge differently; shrink until it fits
            left, cut = budget, []
            for m, c in zip(messages, contents):
                keep = max(0, min(len(c), left))
                left -= keep
                cut.append(dict(m, content=self.tok.decode(c[:keep]) if keep < len(c) else m["content"]))
            ids = self.observation_ids(cut)
            if len(ids) <= limit:
                return ids, cut, True
            budget -= len(ids) - limit
        raise EnvError(f"could not fit the environment's reply into env.max_observation_tokens={limit}.")
