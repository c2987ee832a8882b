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
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Optional, Union

KEYS = {"enter": "<Enter>", "return": "<Enter>", "tab": "<Tab>", "backspace": "<Backspace>",
        "delete": "<Delete>", "space": "<Space>", "arrowup": "<ArrowUp>", "arrowdown": "<ArrowDown>",
        "arrowleft": "<ArrowLeft>", "arrowright": "<ArrowRight>", "up": "<ArrowUp>", "down": "<ArrowDown>",
        "left": "<ArrowLeft>", "right": "<ArrowRight>", "pageup": "<PageUp>", "pagedown": "<PageDown>"}
MAX_TEXT = 64          # MiniWoB's TYPING_MAX_LENGTH
ACTIONS = 'click(x, y), double_click(x, y), type("text"), key("Enter"), scroll(x, y, "down"), or done()'
USAGE = f"write one action: {ACTIONS}"

_CALL = re.compile(r"\b(click|double_click|type|key|scroll|done)\s*\(", re.S)
_TOOL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


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


def _from_tool_call(body: str, width: int, height: int) -> Union[Action, ParseError]:
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return ParseError(f"the tool call is not valid JSON ({e.msg} at column {e.colno}).")
    args = call.get("arguments") if isinstance(call, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict) or not isinstance(args.get("action"), str):
        return ParseError('a computer_use call is {"name": "computer_use", "arguments": {"action": ..., ...}}.')
    act, coord = args["action"], args.get("coordinate")
    coord = list(coord) if isinstance(coord, (list, tuple)) else []
    if act in ("left_click", "click", "double_click"):
        return _build("double_click" if act == "double_click" else "click", coord, width, height)
    if act == "type":
        return _build("type", [args.get("text")], width, height)
    if act == "key":
        keys = args.get("keys", args.get("key"))
        keys = [keys] if isinstance(keys, str) else keys
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
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


def _literal_args(call: ast.Call) -> Union[list, ParseError]:
    if call.keywords and call.args:
        return ParseError("give the arguments by position, e.g. click(12, 40).")
    nodes = call.args or [k.value for k in call.keywords]   # type(text="hi") reads as type("hi")
    try:
        return [ast.literal_eval(n) for n in nodes]
    except (ValueError, SyntaxError):
        return ParseError("arguments must be numbers or quoted strings, e.g. click(12, 40) or type(\"hi\").")


def _from_function(text: str, start: int, width: int, height: int) -> Union[Action, ParseError]:
    # The call ends at the first ")" that closes a parseable expression (strings may hold ")").
    for end in (m.end() for m in re.finditer(r"\)", text[start:])):
        snippet = text[start:start + end]
        try:
            node = ast.parse(snippet, mode="eval").body
        except SyntaxError:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = _literal_args(node)
            return args if isinstance(args, ParseError) else _build(node.func.id, args, width, height)
    return ParseError(f"the action is not closed or not a valid call; {USAGE}.")


def parse_action(text: str, width: int, height: int) -> Union[Action, ParseError]:
    """The one action in a policy's reply, checked against a `width` x `height` screenshot."""
    tools = _TOOL.findall(text)
    if text.count("<tool_call>") > len(tools):
        return ParseError("a <tool_call> is not closed with </tool_call>.")
    if tools:
        if len(tools) > 1:
            return ParseError(f"one action per turn, got {len(tools)} tool calls.")
        return _from_tool_call(tools[0], width, height)
    calls = list(_CALL.finditer(text))
    if not calls:
        return ParseError(f"no action found; {USAGE}.")
    if len(calls) > 1:
        return ParseError(f"one action per turn, got {len(calls)} ({', '.join(c.group(1) for c in calls)}).")
    return _from_function(text, calls[0].start(), width, height)
