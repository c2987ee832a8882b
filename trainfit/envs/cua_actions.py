"""Computer-use actions as a vision-language policy writes them, parsed and checked against the screen.

One action per turn, in either of the two forms Qwen-VL computer-use models emit (text around the call,
e.g. a thought, is ignored):

    click(x, y)                 left click at screenshot pixel (x, y); x to the right, y down, from the
                                top-left corner (0, 0); x < width, y < height
    double_click(x, y)
    type("text")                type into the focused element (JSON or Python string literal)
    key("Enter")                one key: Enter, Tab, Backspace, Delete, Space, ArrowUp/Down/Left/Right,
                                PageUp, PageDown, one printable character, or ctrl+<letter> (e.g.
                                "ctrl+a"); the environment may accept fewer (MiniWoB: ctrl+a/c/x/v)
    scroll(x, y, "down")        scroll the element under (x, y) "up" or "down"
    done()                      the agent thinks the task is finished: ends the episode

    <tool_call>{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [x, y]}}</tool_call>
                                Qwen2.5-VL's computer_use tool: actions left_click, double_click,
                                type (text), key (keys: ["Enter"] or ["ctrl", "a"]), scroll (coordinate,
                                pixels: > 0 up, < 0 down), terminate (= done)

`parse_action(text, width, height)` gives an `Action` or a `ParseError` whose message tells the model what
was wrong and what it may write instead (the environment sends it back as a penalty observation).
Arguments may be named as the signatures above name them (`click(y=40, x=12)` is click(12, 40);
scroll's third is `direction`, key's `key`). Any client can send any text, so the parser is built to
be unbreakable: a reply over MAX_REPLY_CHARS is refused before it is read; a call is read by one
left-to-right pass (a small tokenizer: numbers, quoted strings, `name=`, commas) that stops at the first
thing out of place, never evaluates the text and never recurses; strings and numbers have a length
bound; and a tool call's JSON is checked for nesting depth before json.loads sees it. So the work is
linear in the reply's length and every input gives an Action or a ParseError.

type's text must be typeable (`untypeable`): MiniWoB sends each character as one WebDriver key press;
ChromeDriver fails on a lone surrogate ("missing command parameters") or a noncharacter, and presses keys
for WebDriver's code points U+E000-U+E05D and controls (\b is Backspace, \r dropped): a malformed action
(a penalty, nothing sent) instead of a browser crash; \n (Enter) and \t (Tab) are typed as always.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Union

KEYS = {"enter": "<Enter>", "return": "<Enter>", "tab": "<Tab>", "backspace": "<Backspace>",
        "delete": "<Delete>", "space": "<Space>", "arrowup": "<ArrowUp>", "arrowdown": "<ArrowDown>",
        "arrowleft": "<ArrowLeft>", "arrowright": "<ArrowRight>", "up": "<ArrowUp>", "down": "<ArrowDown>",
        "left": "<ArrowLeft>", "right": "<ArrowRight>", "pageup": "<PageUp>", "pagedown": "<PageDown>"}
MAX_TEXT = 64          # MiniWoB's TYPING_MAX_LENGTH
# A reply is a short thought and one call (the examples write 16 or 256 tokens a turn); longer ones are
# refused unread.
MAX_REPLY_CHARS = 8192
MAX_TOKEN = 256        # characters of one number or string argument (type's text is at most MAX_TEXT)
MAX_JSON_DEPTH = 6     # {"arguments": {"coordinate": [x, y]}} is 3 deep
ACTIONS = 'click(x, y), double_click(x, y), type("text"), key("Enter"), scroll(x, y, "down"), or done()'
USAGE = f"write one action: {ACTIONS}"
PARAMS = {"click": ("x", "y"), "double_click": ("x", "y"), "scroll": ("x", "y", "direction"),
          "type": ("text",), "key": ("key",), "done": ()}

# No nested quantifiers: each is linear in what it reads.
_CALL = re.compile(r"\b(click|double_click|type|key|scroll|done)\s*\(")
_SPACE = re.compile(r"\s*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_LOW_ESCAPE = re.compile(r"\\u(d[c-f][0-9a-f]{2})", re.IGNORECASE)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "0": "\0", "/": "/", "\\": "\\", "'": "'",
            '"': '"'}
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
TYPED_CONTROLS = "\n\t"   # the control characters ChromeDriver types as keys (Enter, Tab) and MiniWoB tasks use
WEBDRIVER_KEYS = range(0xE000, 0xE05E)   # code points WebDriver reads as keys (NULL, Enter, Control...), not text


@dataclass(frozen=True)
class Action:
    kind: str                       # click | double_click | type | key | scroll | done
    x: Optional[float] = None       # screenshot pixels
    y: Optional[float] = None
    text: Optional[str] = None      # type: the text; key: MiniWoB's key name ("<Enter>", "C-a"); scroll: up|down

    def render(self) -> str:
        """The canonical text form (what the expert trajectories write)."""
        if self.kind in ("click", "double_click"):
            return f"{self.kind}({_num(self.x)}, {_num(self.y)})"
        if self.kind == "scroll":
            return f"scroll({_num(self.x)}, {_num(self.y)}, {json.dumps(self.text)})"
        if self.kind == "type":
            return f"type({json.dumps(self.text, ensure_ascii=False)})"
        if self.kind == "key":
            return f"key({json.dumps(_key_name(self.text))})"
        return "done()"


@dataclass(frozen=True)
class ParseError:
    message: str


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.1f}"


def _key_name(miniwob_key: str) -> str:
    if miniwob_key.startswith("C-"):
        return f"ctrl+{miniwob_key[2:]}"
    return miniwob_key.strip("<>") if len(miniwob_key) > 1 else miniwob_key


def miniwob_key(name: str) -> Optional[str]:
    """A key name as the policy writes it -> MiniWoB's (`<Enter>`, `a`, `C-a`), or None if unknown."""
    n = name.strip()
    low = n.lower().replace("_", "").replace(" ", "")
    if low.startswith(("ctrl+", "control+")):
        rest = n.split("+", 1)[1].strip()
        return f"C-{rest.lower()}" if len(rest) == 1 and rest.isalnum() else None
    if low in KEYS:
        return KEYS[low]
    if len(n) == 1 and n.isprintable():
        return n
    return None


def untypeable(text: str) -> Optional[str]:
    """The first character of `text` a browser cannot type, as "U+XXXX, why"; None when all can be."""
    for c in text:
        o = ord(c)
        if 0xD800 <= o <= 0xDFFF:
            why = "a lone surrogate (half of a UTF-16 pair)"
        elif (o < 0x20 and c not in TYPED_CONTROLS) or 0x7F <= o <= 0x9F:
            why = "a control character"
        elif 0xFDD0 <= o <= 0xFDEF or (o & 0xFFFE) == 0xFFFE:
            why = "a Unicode noncharacter"
        elif o in WEBDRIVER_KEYS:
            why = "a WebDriver key code, not text"
        else:
            continue
        return f"U+{o:04X}, {why}"
    return None


def _point(args: list, kind: str, width: int, height: int) -> Union[tuple[float, float], ParseError]:
    if len(args) < 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args[:2]):
        return ParseError(f"{kind} needs two numbers, the pixel x and y: {kind}(x, y).")
    x, y = float(args[0]), float(args[1])
    if not (0 <= x < width and 0 <= y < height):
        return ParseError(f"({_num(x)}, {_num(y)}) is outside the screen: x must be in [0, {width}) and y in "
                          f"[0, {height}) (pixels of the {width}x{height} screenshot).")
    return x, y


def _build(kind: str, args: list, width: int, height: int) -> Union[Action, ParseError]:
    if kind == "done":
        return Action("done")
    if kind in ("click", "double_click"):
        p = _point(args, kind, width, height)
        return p if isinstance(p, ParseError) else Action(kind, *p)
    if kind == "scroll":
        p = _point(args, kind, width, height)
        if isinstance(p, ParseError):
            return p
        direction = args[2] if len(args) > 2 else "down"
        if direction not in ("up", "down"):
            return ParseError(f'scroll direction must be "up" or "down", got {direction!r:.40}.')
        return Action("scroll", *p, text=direction)
    if kind == "type":
        if len(args) != 1 or not isinstance(args[0], str) or not args[0]:
            return ParseError('type needs one non-empty string: type("hello").')
        if len(args[0]) > MAX_TEXT:
            return ParseError(f"type takes at most {MAX_TEXT} characters at once, got {len(args[0])}.")
        bad = untypeable(args[0])
        if bad is not None:
            return ParseError(f"type's text has {bad}, which a browser cannot type; type printable text, and "
                              'press keys with key("Enter").')
        return Action("type", text=args[0])
    if kind == "key":
        if len(args) != 1 or not isinstance(args[0], str):
            return ParseError('key needs one key name: key("Enter").')
        k = miniwob_key(args[0])
        if k is None:
            return ParseError(f"unknown key {args[0]!r:.40}: use Enter, Tab, Backspace, Delete, Space, an arrow "
                              "(ArrowUp...), PageUp, PageDown, one character, or ctrl+<letter>.")
        return Action("key", text=k)
    return ParseError(f"unknown action {kind!r}; {USAGE}.")


def json_too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether brackets outside strings nest deeper than `limit`: json.loads recurses once per level, so
    a reply of nothing but `[` would end in a RecursionError (or take the process's stack) instead of
    an answer."""
    depth, in_str, escaped = 0, False, False
    for c in text:
        if in_str:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
            if depth > limit:
                return True
        elif c in "]}":
            depth -= 1
    return False


def _json(text: str, what: str) -> Union[object, ParseError]:
    if json_too_deep(text):
        return ParseError(f"{what} nests brackets more than {MAX_JSON_DEPTH} deep.")
    try:
        # parse_int=float: a number of thousands of digits is a float here, not int()'s digit-limit ValueError.
        return json.loads(text.strip(), parse_int=float)
    except json.JSONDecodeError as e:
        return ParseError(f"{what} is not valid JSON ({e.msg} at column {e.colno}).")
    except (ValueError, RecursionError) as e:
        return ParseError(f"{what} is not valid JSON ({type(e).__name__}).")


def _from_tool_call(body: str, width: int, height: int) -> Union[Action, ParseError]:
    call = _json(body, "the tool call")
    if isinstance(call, ParseError):
        return call
    args = call.get("arguments") if isinstance(call, dict) else None
    if isinstance(args, str):
        args = _json(args, 'the tool call\'s "arguments"')
        if isinstance(args, ParseError):
            return args
    if not isinstance(args, dict) or not isinstance(args.get("action"), str):
        return ParseError('a computer_use call is {"name": "computer_use", "arguments": {"action": ..., ...}}.')
    act, coord = args["action"], args.get("coordinate")
    coord = list(coord[:3]) if isinstance(coord, list) else []
    if act in ("left_click", "click", "double_click"):
        return _build("double_click" if act == "double_click" else "click", coord, width, height)
    if act == "type":
        return _build("type", [args.get("text")], width, height)
    if act == "key":
        keys = args.get("keys", args.get("key"))
        keys = [keys] if isinstance(keys, str) else keys
        if not isinstance(keys, list) or not 0 < len(keys) <= 4 or not all(isinstance(k, str) for k in keys):
            return ParseError('key needs "keys": a list of key names, e.g. ["Enter"] or ["ctrl", "a"].')
        return _build("key", ["+".join(keys)], width, height)
    if act == "scroll":
        pixels = args.get("pixels", -1)
        if not isinstance(pixels, (int, float)) or isinstance(pixels, bool):
            return ParseError('scroll needs "pixels", a number (> 0 scrolls up, < 0 down).')
        return _build("scroll", coord[:2] + ["up" if pixels > 0 else "down"], width, height)
    if act in ("terminate", "done", "answer"):
        return Action("done")
    return ParseError(f"computer_use action {act!r:.40} is not supported here; use left_click, double_click, "
                      "type, key, scroll or terminate.")


def _string(text: str, i: int) -> Union[tuple[str, int], ParseError]:
    """The quoted string starting at text[i] (JSON and Python escapes) and the index after it."""
    quote, out, j, n = text[i], [], i + 1, len(text)
    while j < n:
        c = text[j]
        if c == quote:
            return "".join(out), j + 1
        if len(out) >= MAX_TOKEN:
            return ParseError(f"a string argument is longer than {MAX_TOKEN} characters.")
        if c == "\\" and j + 1 < n:
            e = text[j + 1]
            if e in "ux":
                digits = text[j + 2:j + (6 if e == "u" else 4)]
                if len(digits) != (4 if e == "u" else 2) or any(d not in "0123456789abcdefABCDEF" for d in digits):
                    return ParseError(f"a string has a bad \\{e} escape; write the character itself.")
                o, j = int(digits, 16), j + 2 + len(digits)
                low = _LOW_ESCAPE.match(text, j) if 0xD800 <= o <= 0xDBFF else None
                if low is not None:   # \ud83d\ude00 is one character (as JSON reads it), not two halves
                    o, j = 0x10000 + ((o - 0xD800) << 10) + (int(low.group(1), 16) - 0xDC00), low.end()
                out.append(chr(o))
                continue
            out.append(_ESCAPES.get(e, "\\" + e))   # an unknown escape stays as written (as Python does)
            j += 2
            continue
        out.append(c)
        j += 1
    return ParseError(f"a string argument is not closed with {quote}; {USAGE}.")


def _value(text: str, i: int) -> Union[tuple[object, int], ParseError]:
    """A number or a quoted string at text[i], and the index after it."""
    if i < len(text) and text[i] in "\"'":
        return _string(text, i)
    m = _NUMBER.match(text, i)
    if m is None:
        return ParseError("arguments must be numbers or quoted strings, e.g. click(12, 40) or type(\"hi\").")
    if m.end() - i > MAX_TOKEN:
        return ParseError(f"a number argument is longer than {MAX_TOKEN} characters.")
    return float(m.group()), m.end()


def _call_args(text: str, i: int, kind: str) -> Union[tuple[list, dict, int], ParseError]:
    """The arguments of the call whose "(" ends at text[i - 1]: (positional, named, index after ")").

    One pass left to right that stops at the first thing out of place: a value, optionally `name=`
    before it, then "," or ")"; at most len(PARAMS[kind]) + 1 arguments (done() may carry a status)."""
    pos, named, n = [], {}, len(text)
    i = _SPACE.match(text, i).end()
    if i < n and text[i] == ")":
        return pos, named, i + 1
    while True:
        if len(pos) + len(named) > len(PARAMS[kind]):
            return ParseError(f"{kind} takes {_signature(kind)}: too many arguments.")
        name = None
        m = _NAME.match(text, i)
        if m is not None:
            j = _SPACE.match(text, m.end()).end()
            if j >= n or text[j] != "=" or m.end() - i > MAX_TOKEN:
                return ParseError("arguments must be numbers or quoted strings, e.g. click(12, 40) or type(\"hi\").")
            name, i = m.group(), _SPACE.match(text, j + 1).end()
        got = _value(text, i)
        if isinstance(got, ParseError):
            return got
        value, i = got
        if name is None:
            if named:
                return ParseError(f"a positional argument follows a named one in {kind}(...); "
                                  f"write {_signature(kind)}.")
            pos.append(value)
        elif name in named:
            return ParseError(f"{kind} got {name}= twice.")
        else:
            named[name] = value
        i = _SPACE.match(text, i).end()
        if i >= n:
            return ParseError(f"the action is not closed with \")\"; {USAGE}.")
        if text[i] == ")":
            return pos, named, i + 1
        if text[i] != ",":
            return ParseError(f"{kind}(...) has {text[i]!r} after argument {len(pos) + len(named)} where \",\" or "
                              f"\")\" belongs; write {_signature(kind)}.")
        i = _SPACE.match(text, i + 1).end()
        if i < n and text[i] == ")":       # a trailing comma, as Python allows
            return pos, named, i + 1


def _signature(kind: str) -> str:
    return f"{kind}({', '.join(PARAMS[kind])})"


def _bind(kind: str, pos: list, named: dict) -> Union[list, ParseError]:
    """Positional and named arguments -> the positional list _build reads, as Python binds a call."""
    params = PARAMS[kind]
    if kind == "done":
        return []
    unknown = [k for k in named if k not in params]
    if unknown:
        return ParseError(f"{kind} has no argument {unknown[0]!r:.40}; write {_signature(kind)}.")
    if len(pos) > len(params):
        return ParseError(f"{kind} takes {_signature(kind)}: too many arguments.")
    twice = [p for p in params[:len(pos)] if p in named]
    if twice:
        return ParseError(f"{kind} got {twice[0]} both by position and as {twice[0]}=.")
    args = [pos[k] if k < len(pos) else named.get(p) for k, p in enumerate(params)]
    while args and args[-1] is None:
        args.pop()
    return args


def _from_functions(text: str, width: int, height: int) -> Union[Action, ParseError]:
    calls, i = [], 0
    while (m := _CALL.search(text, i)) is not None:
        kind = m.group(1)
        got = _call_args(text, m.end(), kind)
        if isinstance(got, ParseError):
            return got            # the first malformed call ends the reading: no rescans, linear time
        pos, named, i = got
        calls.append((kind, pos, named))
    if not calls:
        return ParseError(f"no action found; {USAGE}.")
    if len(calls) > 1:
        return ParseError(f"one action per turn, got {len(calls)} ({', '.join(c[0] for c in calls[:8])}).")
    kind, pos, named = calls[0]
    args = _bind(kind, pos, named)
    return args if isinstance(args, ParseError) else _build(kind, args, width, height)


def _tool_bodies(text: str) -> Union[list[str], ParseError]:
    bodies, i = [], 0
    while (start := text.find(_OPEN, i)) != -1:
        start += len(_OPEN)
        end = text.find(_CLOSE, start)
        if end == -1 or _OPEN in text[start:end]:
            return ParseError("a <tool_call> is not closed with </tool_call>.")
        bodies.append(text[start:end])
        i = end + len(_CLOSE)
    return bodies


def parse_action(text: str, width: int, height: int) -> Union[Action, ParseError]:
    """The one action in a policy's reply, checked against a `width` x `height` screenshot."""
    if not isinstance(text, str):
        return ParseError(f"the action must be text; {USAGE}.")
    if len(text) > MAX_REPLY_CHARS:
        return ParseError(f"the reply is {len(text)} characters, over the {MAX_REPLY_CHARS} read; {USAGE}.")
    tools = _tool_bodies(text)
    if isinstance(tools, ParseError):
        return tools
    if tools:
        if len(tools) > 1:
            return ParseError(f"one action per turn, got {len(tools)} tool calls.")
        return _from_tool_call(tools[0], width, height)
    return _from_functions(text, width, height)
