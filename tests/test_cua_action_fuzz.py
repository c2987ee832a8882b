"""The computer-use action parser (envs/cua_actions.py) against any input: property tests (hypothesis)
seeded with the inputs that once took the environment service down (a RecursionError or MemoryError
from recursive evaluation, or 20 s of quadratic scanning on 128 KB), keyword arguments bound by name,
and adversarial text far over the reply cap read in bounded work. No browser, no timing assertions."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trainfit.envs import cua_actions
from trainfit.envs.cua_actions import MAX_REPLY_CHARS, Action, ParseError, parse_action

W, H = 160, 210
# Derandomized and without an example database: the same cases on every machine, no files written.
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# The inputs of the report: each broke the recursive parser (or took 20 s).
NESTED_TOOL_CALL = "<tool_call>" + "[" * 1000 + "</tool_call>"
LONG_SUM = "click(" + "+".join(["1"] * 3000) + ")"
MANY_SIGNS = "click(" + "-" * 3000 + "1, 2)"
QUADRATIC = 'click("' + "a)" * 64000                     # 128 KB


def check(got) -> None:
    """What every input must give: an Action on the screen, or a ParseError with a short message."""
    assert isinstance(got, (Action, ParseError)), got
    if isinstance(got, ParseError):
        assert got.message and len(got.message) < 400
    elif got.kind in ("click", "double_click", "scroll"):
        assert 0 <= got.x < W and 0 <= got.y < H


TOKENS = st.sampled_from(["1", "-", "+", "2.5", ".", ",", " ", "(", ")", "[", "]", "{", "}", "=", "x", "y", "text",
                          '"', "'", "\\", "\\u00e9", "\\x4", "a)", "click(", "type(", "<tool_call>", "</tool_call>",
                          '{"action": "left_click"', '"coordinate": [', "1e5", "\n", "é"])
CALLISH = st.builds(lambda kind, parts, close: kind + "(" + "".join(parts) + close,
                    st.sampled_from(["click", "double_click", "type", "key", "scroll", "done", "clicks"]),
                    st.lists(TOKENS, max_size=40), st.sampled_from([")", "", ")) click(1, 2)"]))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: (st.lists(inner, max_size=4)
                                   | st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                    max_leaves=12)
TOOL_ARGS = st.fixed_dictionaries({"action": st.sampled_from(["left_click", "double_click", "type", "key", "scroll",
                                                              "terminate", "drag"])},
                                  optional={"coordinate": JSON, "text": JSON, "keys": JSON, "pixels": JSON})


@FUZZ
@given(st.text(max_size=300))
@example(NESTED_TOOL_CALL)
@example(LONG_SUM)
@example(MANY_SIGNS)
@example(QUADRATIC)
@example("<tool_call>" * 5000)
@example("click(" * 2000)
@example('type("' + "\\" * 4000)
@example("click(" + "9" * 5000 + ", 1)")
def test_any_text_gives_an_action_or_a_parse_error(text):
    check(parse_action(text, W, H))


@FUZZ
@given(CALLISH, st.text(max_size=40))
def test_call_shaped_text_gives_an_action_or_a_parse_error(call, thought):
    check(parse_action(thought + call, W, H))


@FUZZ
@given(st.one_of(JSON, st.fixed_dictionaries({"name": st.just("computer_use"), "arguments": TOOL_ARGS})),
       st.booleans())
def test_tool_calls_give_an_action_or_a_parse_error(body, as_string):
    import json

    if as_string and isinstance(body, dict) and isinstance(body.get("arguments"), dict):
        body = {**body, "arguments": json.dumps(body["arguments"])}   # arguments as a JSON string, as some models do
    check(parse_action(f"<tool_call>{json.dumps(body)}</tool_call>", W, H))


@pytest.mark.parametrize("text, says", [
    (NESTED_TOOL_CALL, "nests brackets more than 6 deep"),
    ("<tool_call>" + '{"arguments": "' + "[" * 1000 + '"}' + "</tool_call>", "nests brackets"),
    (LONG_SUM, "'+' after argument 1 where \",\" or \")\" belongs"),
    (MANY_SIGNS, "arguments must be numbers or quoted strings"),
    (QUADRATIC, f"over the {MAX_REPLY_CHARS} read"),
    ('<tool_call>{"arguments": {"action": "left_click", "coordinate": [' + "9" * 5000 + ", 1]}}</tool_call>",
     "outside the screen"),
])
def test_the_reported_inputs_are_penalised_with_a_reason(text, says):
    got = parse_action(text, W, H)
    assert isinstance(got, ParseError) and says in got.message, got


ADVERSARIAL_128K = [QUADRATIC, "click(" * 22000, 'click("' + "\\" * 131000, "<tool_call>" * 12000,
                    "<tool_call>" + "[" * 131000 + "</tool_call>", "click(1, 2) " * 11000,
                    "click(" + " " * 131000 + "1, 2)", "click " * 22000 + "(", "type" * 33000]


@pytest.mark.timeout(5)   # bounded work: the quadratic parser of before took 20 s on one of these
@pytest.mark.parametrize("text", ADVERSARIAL_128K, ids=lambda t: repr(t[:16]))
def test_128_kb_of_adversarial_text_is_read_in_bounded_work_even_without_the_cap(monkeypatch, text):
    # The cap alone would refuse these unread; lifted, the one-pass parser still gets through each
    # (the recursive parser of before overflowed the stack or rescanned the text once per ")").
    assert len(text) >= 128_000
    monkeypatch.setattr(cua_actions, "MAX_REPLY_CHARS", 1 << 20)
    got = parse_action(text, W, H)
    check(got)
    assert isinstance(got, ParseError) or got == Action("click", 1.0, 2.0)


@FUZZ
@given(st.integers(0, W - 1), st.integers(0, H - 1), st.booleans(), st.sampled_from(["click", "double_click"]))
def test_named_arguments_bind_by_name(x, y, x_first, kind):
    named = f"x={x}, y={y}" if x_first else f"y={y}, x={x}"
    assert parse_action(f"{kind}({named})", W, H) == Action(kind, float(x), float(y))
    assert parse_action(f"{kind}({x}, y={y})", W, H) == Action(kind, float(x), float(y))


@pytest.mark.parametrize("text, want", [
    ("click(y=100, x=10)", Action("click", 10.0, 100.0)),
    ('scroll(direction="up", y=5, x=6)', Action("scroll", 6.0, 5.0, "up")),
    ('key(key="Enter")', Action("key", text="<Enter>")),
    ('type(text="a \\"b\\" \\u00e9")', Action("type", text='a "b" é')),
    ("click(1, 2,)", Action("click", 1.0, 2.0)),
    ('done(status="success")', Action("done")),
])
def test_named_and_trailing_arguments(text, want):
    assert parse_action(text, W, H) == want


@pytest.mark.parametrize("text, says", [
    ("click(x=1, x=2)", "got x= twice"),
    ("click(1, x=2)", "both by position and as x="),
    ("click(x=1, 2)", "positional argument follows a named one"),
    ("click(z=1, y=2)", "has no argument 'z'"),
    ("click(1, 2, 3)", "too many arguments"),
    ("click(y=2)", "needs two numbers"),
    ('type("' + "a" * 300 + '")', "longer than 256 characters"),
    ("click(" + "1" * 300 + ", 2)", "longer than 256 characters"),
    ('type("a\\u12")', "bad \\u escape"),
])
def test_argument_mistakes_say_what_is_wrong(text, says):
    got = parse_action(text, W, H)
    assert isinstance(got, ParseError) and says in got.message, got


# --- type's text is what a browser can type (MiniWoB sends each character as one WebDriver key press) ---

# Every code point, surrogates included (hypothesis leaves them out of text() unless asked).
ANY_CHAR = st.characters(exclude_categories=())
REFUSED = ["\ud800", "\udfff", "\x00", "\x08", "\r", "\x1b", "\x7f", "\x85", "\x9f", "\ufdd0", "\ufffe", "\U0010ffff",
           "\ue000", "\ue007", "\ue05d"]


def typeable(text: str) -> bool:
    """What ChromeDriver types as text, from its rules rather than the parser's code: valid UTF-8 (no lone
    surrogate), \\n and \\t the only controls, no noncharacter, no WebDriver key code point."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return all(c in "\n\t" or not (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or 0xFDD0 <= ord(c) <= 0xFDEF
                                   or ord(c) % 0x10000 >= 0xFFFE or 0xE000 <= ord(c) <= 0xE05D) for c in text)


def check_typeable(got) -> None:
    check(got)
    if isinstance(got, Action) and got.kind == "type":
        assert typeable(got.text), got
    if isinstance(got, ParseError):
        got.message.encode("utf-8")     # the penalty goes back to the policy's tokenizer: no lone surrogate in it


@FUZZ
@given(st.text(ANY_CHAR, min_size=1, max_size=12), st.sampled_from(["escaped", "literal", "tool_call"]))
def test_any_unicode_text_to_type_is_typeable_or_refused(text, form):
    import json

    if form == "escaped":          # as a policy writes it in JSON: lone surrogates as \udXXX escapes
        reply = f"type({json.dumps(text)})"
    elif form == "literal":        # the characters themselves (a client's JSON body may carry any)
        reply = 'type("' + text.replace("\\", "\\\\").replace('"', '\\"') + '")'
    else:
        reply = "<tool_call>" + json.dumps({"name": "computer_use", "arguments": {"action": "type", "text": text}}) \
            + "</tool_call>"
    got = parse_action(reply, W, H)
    check_typeable(got)
    assert isinstance(got, ParseError) or got == Action("type", text=text)
    assert isinstance(got, Action) == typeable(text), (text, got)


@FUZZ
@given(st.text(ANY_CHAR, max_size=300))
@example('type("\\ud800")')
@example('<tool_call>{"name": "computer_use", "arguments": {"action": "type", "text": "\\ud800"}}</tool_call>')
def test_any_unicode_reply_gives_a_typeable_action_or_a_parse_error(text):
    check_typeable(parse_action(text, W, H))


@pytest.mark.parametrize("char", REFUSED, ids=lambda c: f"U+{ord(c):04X}")
@pytest.mark.parametrize("form", ["type", "tool_call"])
def test_untypeable_characters_are_refused_naming_the_code_point(char, form):
    import json

    text = f"a{char}b"
    reply = (f"type({json.dumps(text)})" if form == "type" else "<tool_call>" + json.dumps(
        {"name": "computer_use", "arguments": {"action": "type", "text": text}}) + "</tool_call>")
    got = parse_action(reply, W, H)
    assert isinstance(got, ParseError) and f"U+{ord(char):04X}" in got.message and "cannot type" in got.message, got


@pytest.mark.parametrize("reply, text", [
    ('type("a\\nb\\tc")', "a\nb\tc"),                 # Enter and Tab are typed as before
    ('type("\\ud83d\\ude00 \\u00e9")', "\U0001F600 é"),  # a surrogate pair written as escapes is one character
    ('type("\\u200d\\ue05e\\U")', "\u200d\ue05e\\U"),     # format and private-use characters are text
])
def test_typeable_text_still_parses(reply, text):
    assert parse_action(reply, W, H) == Action("type", text=text)
