"""One expert for MiniWoB++ tasks: it reads the task's utterance and the page's DOM, as a person reads the
instruction and the screen, and says the next action.

    advice = advise(utterance, elements, history)   # Advice(action, why): action None -> `why` says why
    advice = advise('Enter "Jerald" into the text field and press Submit.', dom_view(obs), [])

`elements` are the DOM elements of the current screen as `dom_view` gives them (tag, text, value, classes,
id, box in screenshot pixels, focused, tampered); `history` the actions already applied in the episode
(only a closed <select>, whose choice the DOM does not show, needs it).
The utterance is read by INSTRUCTIONS: each phrasing MiniWoB++ uses for a kind of request ("Click on the
"X" button.", "Enter the username "U" and the password "P" ...", "Select A, B and click Submit.") becomes
a plan of goals, and each goal looks at the screen: fill a field until it holds the text, tick exactly the
named boxes, expand what is collapsed, then click the target or Submit. A goal already met is skipped, so
the expert may be asked at any point of an episode, also after another agent's actions. Clicks go to the
centre of the element's box (truncated to whole pixels), or, where a control drawn later covers that,
to its nearest pixel nothing covers. No task names: a task whose utterance no instruction reads, or a
screen without what the plan needs, gets no action and a reason.
SOLVED lists the tasks where the expert was measured to succeed (bench/cua_expert_eval.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from .cua_actions import Action

# Measured by bench/cua_expert_eval.py (bench/results/cua_expert.json): success on each of 25 unseen
# instances a task. `trainfit env expert` writes rows for these.
SOLVED = ("click-button", "click-button-sequence", "click-checkboxes", "click-collapsible", "click-dialog",
          "click-dialog-2", "click-link", "click-option", "click-tab", "click-test", "click-test-2",
          "click-widget", "choose-list", "enter-password", "enter-text", "enter-text-2", "enter-text-dynamic",
          "focus-text", "focus-text-2", "grid-coordinate", "login-user", "navigate-tree", "unicode-test")


@dataclass(frozen=True)
class Advice:
    action: Optional[Action]
    why: str = ""            # when there is no action: what the expert could not read or find


def dom_view(obs: dict) -> list[dict]:
    """MiniWoB's observation DOM as plain values: one dict per visible element. A checkbox's or radio's
    value is "True" when checked ("" otherwise); `tampered`: clicked, focused or typed into this episode."""
    out = []
    for e in obs.get("dom_elements") or []:
        box = [float(e[k][0]) for k in ("left", "top", "width", "height")]
        out.append({"ref": int(e["ref"]), "tag": str(e["tag"]), "text": str(e["text"]), "value": str(e["value"]),
                    "id": str(e["id"]), "classes": str(e["classes"]), "box": box,
                    "focused": bool(e["flags"][0]), "tampered": bool(e["flags"][1])})
    return out


def _control(e: dict) -> bool:
    return e["tag"] in ("button", "textarea", "select", "a") or e["tag"].startswith("input_")


class Stuck(Exception):
    """The screen lacks what the plan needs; the message says what."""


DONE = None       # a goal that is met returns DONE; one that is not returns its next Action
Goal = Callable[[list, Sequence[Action]], Optional[Action]]


def _centre(e: dict) -> Action:
    left, top, w, h = e["box"]
    return Action("click", float(int(left + w / 2)), float(int(top + h / 2)))


def _inside(box: list, x: float, y: float) -> bool:
    return box[0] <= x < box[0] + box[2] and box[1] <= y < box[1] + box[3]


def _aim(e: dict, elements: list) -> Action:
    """A click on `e` where nothing lies over it: its centre, unless a control drawn later (on top; not
    one of its own children, which lie within its box) covers that, then the free pixel nearest to it.
    Only controls count: text's box is the union of its lines, so a wrapped span's box covers more of
    the page than its words do."""
    left, top, w, h = e["box"]
    i = next(k for k, o in enumerate(elements) if o is e)
    over = [o["box"] for o in elements[i + 1:] if _control(o) and not (
            o["box"][0] >= left and o["box"][1] >= top and
            o["box"][0] + o["box"][2] <= left + w and o["box"][1] + o["box"][3] <= top + h)]
    centre = _centre(e)
    if not any(_inside(b, centre.x, centre.y) for b in over):
        return centre
    points = sorted(((float(x), float(y)) for x in range(int(left) + 1, int(left + w) - 1)
                     for y in range(int(top) + 1, int(top + h) - 1)),
                    key=lambda p: (p[0] - centre.x) ** 2 + (p[1] - centre.y) ** 2)
    for x, y in points:
        if not any(_inside(b, x, y) for b in over):
            return Action("click", x, y)
    raise Stuck(f"the {e['tag']} \"{e['text'][:40]}\" is covered by other elements")


def _classes(e: dict) -> list[str]:
    return e["classes"].split()


def _find(elements: list, pred: Callable[[dict], bool], what: str) -> dict:
    e = next((e for e in elements if pred(e)), None)
    if e is None:
        raise Stuck(f"no {what} on the screen")
    return e


def _named(text: str, tags: Optional[tuple] = None) -> Callable[[dict], bool]:
    """Elements showing exactly `text` (then the same text in another case), of one of `tags` if given."""
    def pred(e: dict) -> bool:
        return (tags is None or e["tag"] in tags) and e["text"].strip().casefold() == text.casefold()
    return pred


def _by_text(elements: list, text: str, tags: Optional[tuple], what: str) -> dict:
    exact = [e for e in elements if (tags is None or e["tag"] in tags) and e["text"].strip() == text]
    return exact[0] if exact else _find(elements, _named(text, tags), what)


def _label(elements: list, i: int) -> str:
    """The text a person reads as input i's label: the text right after it inside its <label> (checkboxes,
    radios), else the nearest <label> before it."""
    if i + 1 < len(elements) and elements[i + 1]["tag"] == "t":
        return elements[i + 1]["text"].strip()
    for e in reversed(elements[:i]):
        if e["tag"] == "label" and e["text"].strip():
            return e["text"].strip()
        if e["tag"].startswith("input") or e["tag"] == "textarea":
            break
    return ""


# Goals: each looks at the screen and gives its next action, or DONE when it is met.

def click(pred: Callable[[dict], bool], what: str) -> Goal:
    return lambda elements, history: _aim(_find(elements, pred, what), elements)


def click_text(text: str, tags: Optional[tuple] = None, what: str = "") -> Goal:
    what = what or f'{"/".join(tags) if tags else "element"} "{text}"'
    return lambda elements, history: _aim(_by_text(elements, text, tags, what), elements)


def click_once(text: str, tags: tuple) -> Goal:
    """Click the element once (a step of a sequence: met when MiniWoB marks it tampered)."""
    def goal(elements, history):
        e = _by_text(elements, text, tags, f'{"/".join(tags)} "{text}"')
        return DONE if e["tampered"] else _aim(e, elements)
    return goal


def fill(pick: Callable[[list], list], text: str, what: str) -> Goal:
    """Every field `pick` chooses holds `text`: click into it, select what is there, type."""
    def goal(elements, history):
        fields = pick(elements)
        if not fields:
            raise Stuck(f"no {what} on the screen")
        for box in fields:
            if box["value"] == text:
                continue
            if not box["focused"]:
                return _aim(box, elements)
            if box["value"]:       # something else was typed: select it all, then typing replaces it
                return Action("key", text="C-a")
            return Action("type", text=text)
        return DONE
    return goal


def tick(labels: list[str], kind: str) -> Goal:
    """Exactly the boxes labelled `labels` checked (kind: input_checkbox or input_radio)."""
    want = {s.casefold() for s in labels}

    def goal(elements, history):
        boxes = [(e, _label(elements, i).casefold()) for i, e in enumerate(elements) if e["tag"] == kind]
        missing = want - {lab for _, lab in boxes}
        if missing:
            raise Stuck(f"no {kind[6:]} labelled {', '.join(sorted(missing))} on the screen")
        for e, lab in boxes:
            if (e["value"] == "True") != (lab in want):
                return _aim(e, elements)
        return DONE
    return goal


def choose(text: str) -> Goal:
    """Pick `text` in a drop-down list: click it open, type the option's text (the browser selects the
    option it starts), which the DOM does not show, so the history says whether it was typed."""
    def goal(elements, history):
        if Action("type", text=text) in history:
            return DONE
        sel = _find(elements, lambda e: e["tag"] == "select", "drop-down list")
        return Action("type", text=text) if sel["focused"] else _aim(sel, elements)
    return goal


def expand(elements, history):
    """Open every collapsed accordion section."""
    closed = [e for e in elements if "ui-accordion-header-collapsed" in _classes(e)]
    return _aim(closed[0], elements) if closed else DONE


def reveal(text: str) -> Goal:
    """Open folders of a tree until an element shows `text` (then met)."""
    def goal(elements, history):
        if any(_named(text)(e) for e in elements):
            return DONE
        return _aim(_find(elements, lambda e: "expandable-hitarea" in _classes(e),
                          f'file or folder "{text}" (and no closed folder left to open)'), elements)
    return goal


def submit(name: str = "submit") -> Goal:
    return click_text(name, ("button",), f'"{name}" button')


# The instructions: an utterance's phrasing -> a plan. Order matters where one phrasing contains another.

def _texts(elements: list, tag: str) -> list:
    return [e for e in elements if e["tag"] == tag]


def _labelled(key: str, tags: tuple) -> Callable[[list], list]:
    return lambda elements: [e for i, e in enumerate(elements) if e["tag"] in tags and
                             (e["id"].casefold() == key or _label(elements, i).casefold() == key)]


WIDGETS = {"button": ("button",), "text": ("input_text",), "textarea": ("textarea",),
           "checkbox": ("input_checkbox",), "radio": ("input_radio",)}
_CLOSE_X = (lambda e: "ui-dialog-titlebar-close" in _classes(e), 'dialog\'s "x"')


def _nth(n: int) -> Goal:
    def goal(elements, history):
        boxes = _texts(elements, "input_text")
        if not 0 < n <= len(boxes):
            raise Stuck(f"no text box number {n} ({len(boxes)} on the screen)")
        return _aim(boxes[n - 1], elements)
    return goal


def _select_boxes(targets: str) -> Goal:
    """"Select A, B and click Submit.": checkboxes (several, or "nothing") or radios (one), whichever the
    screen has."""
    labels = [] if targets == "nothing" else re.split(r", ?", targets)

    def goal(elements, history):
        kind = "input_radio" if any(e["tag"] == "input_radio" for e in elements) else "input_checkbox"
        return tick(labels, kind)(elements, history)
    return goal


InstructionPlan = Callable[[re.Match], list]
INSTRUCTIONS: list[tuple[str, Union[InstructionPlan, str]]] = [
    (r"Click the button\.", lambda m: [click(lambda e: e["tag"] == "button", "button")]),
    (r"Click button (.+), then click button (.+)\.",
     lambda m: [click_once(m[1], ("button",)), click_text(m[2], ("button",))]),
    (r"Click button (.+)\.", lambda m: [click_text(m[1], ("button",))]),
    (r'Click on the "(.+)" button\.', lambda m: [click_text(m[1], ("button",))]),
    (r"Close the dialog box by clicking the \"x\"\.", lambda m: [click(*_CLOSE_X)]),
    (r'Click the button in the dialog box labeled "(.+)"\.',
     lambda m: [click(*_CLOSE_X) if m[1] == "x" else click_text(m[1], ("button",))]),
    (r'Click on the link "(.+)"\.', lambda m: [click(
        lambda e: (e["tag"] == "a" or "alink" in _classes(e)) and e["text"] == m[1], f'link "{m[1]}"')]),
    (r"Click on Tab #(\d+)\.", lambda m: [click_text(f"Tab #{m[1]}", ("a",))]),
    (r"Focus into the textbox\.", lambda m: [click(lambda e: e["tag"] == "input_text", "text box")]),
    (r"Focus into the (\d+)\w\w input textbox\.", lambda m: [_nth(int(m[1]))]),
    (r'Enter "(.*)" into the text field and press Submit\.',
     lambda m: [fill(lambda els: _texts(els, "input_text")[:1], m[1], "text field"), submit()]),
    (r'Type "(.*)" in all (upper|lower) case letters in the text input and press Submit\.',
     lambda m: [fill(lambda els: _texts(els, "input_text")[:1], m[1].upper() if m[2] == "upper" else m[1].lower(),
                     "text input"), submit()]),
    (r'Enter the password "(.*)" into both text fields and press submit\.',
     lambda m: [fill(lambda els: _texts(els, "input_password"), m[1], "password field"), submit()]),
    (r'Enter the username "(.*)" and the password "(.*)" into the text fields and press login\.',
     lambda m: [fill(_labelled("username", ("input_text",)), m[1], "username field"),
                fill(_labelled("password", ("input_password",)), m[2], "password field"), submit("login")]),
    (r"Select (.+) from the list and click Submit\.", lambda m: [choose(m[1]), submit()]),
    (r"Select (.+) from the scroll list and click Submit\.",
     "choosing several options of a list box needs ctrl+click, which MiniWoB's actions do not have"),
    (r"Select words similar to .*", "choosing words by their meaning is beyond reading the DOM"),
    (r"Select (.+) and click Submit\.",
     lambda m: [_select_boxes(m[1]), submit()]),
    (r'Click on a "(.+)" widget\.', lambda m: [click(lambda e: e["tag"] in WIDGETS.get(m[1], ()),
                                                      f'"{m[1]}" widget')]),
    (r"Expand the section below and click submit\.", lambda m: [expand, submit()]),
    (r"Click on the grid coordinate \((-?\d+),(-?\d+)\)\.",
     lambda m: [click(lambda e: e["id"] == f"({m[1]},{m[2]})", f"grid point ({m[1]},{m[2]})")]),
    (r'Navigate through the file tree\. Find and click on the folder or file named "(.+)"\.',
     lambda m: [reveal(m[1]), click_text(m[1], ("span",), f'file or folder "{m[1]}"')]),
]


_COMPILED = [(re.compile(p), plan) for p, plan in INSTRUCTIONS]


def advise(utterance: str, elements: list, history: Sequence[Action] = ()) -> Advice:
    """The next action a correct agent takes on this screen, or no action and why."""
    for pattern, plan in _COMPILED:
        m = pattern.fullmatch(utterance.strip())
        if m is None:
            continue
        if isinstance(plan, str):
            return Advice(None, f"the expert reads this instruction but cannot act on it: {plan}")
        try:
            for goal in plan(m):
                act = goal(elements, history)
                if act is not DONE:
                    return Advice(act)
        except Stuck as e:
            return Advice(None, f"{e} (instruction: {utterance.strip()[:120]})")
        return Advice(None, "every goal of the instruction is met already; nothing left to do")
    return Advice(None, f"no instruction the expert reads matches the utterance {utterance.strip()[:120]!r}")
