"""Expert actions for MiniWoB++ tasks whose DOM tells what a correct agent does next.

    action = expert_action("enter-text", fields, elements)    # Action or None (no expert / nothing to do)

`fields` are MiniWoB's parsed utterance fields ({"target": "Jerald"}), `elements` the DOM elements of the
current screen as `dom_view` gives them (tag, text, classes, id, box in screenshot pixels, focused).
An expert acts like a person who reads the screen: it clicks the centre of the right element, types what
the task asks for, and presses Submit; applied turn by turn through the service, its episodes succeed.
"""

from __future__ import annotations

from typing import Callable, Optional

from .cua_actions import Action


def dom_view(obs: dict) -> list[dict]:
    """MiniWoB's observation DOM as plain values: one dict per visible element."""
    out = []
    for e in obs.get("dom_elements") or []:
        box = [float(e[k][0]) for k in ("left", "top", "width", "height")]
        out.append({"ref": int(e["ref"]), "tag": str(e["tag"]), "text": str(e["text"]), "value": str(e["value"]),
                    "id": str(e["id"]), "classes": str(e["classes"]), "box": box,
                    "focused": bool(e["flags"][0])})
    return out


def _centre(e: dict) -> Action:
    left, top, w, h = e["box"]
    return Action("click", float(int(left + w / 2)), float(int(top + h / 2)))


def _first(elements: list[dict], pred: Callable[[dict], bool]) -> Optional[dict]:
    return next((e for e in elements if pred(e)), None)


def _click(pred: Callable[[dict, dict], bool]):
    def act(fields: dict, elements: list[dict]) -> Optional[Action]:
        e = _first(elements, lambda e: pred(e, fields))
        return _centre(e) if e else None
    return act


def _enter_text(fields: dict, elements: list[dict]) -> Optional[Action]:
    box = _first(elements, lambda e: e["tag"] == "input_text")
    if box is None:
        return None
    if box["value"] != fields.get("target", ""):
        if not box["focused"]:
            return _centre(box)
        if box["value"]:       # something else was typed: select it all, then typing replaces it
            return Action("key", text="C-a")
        return Action("type", text=fields.get("target", ""))
    submit = _first(elements, lambda e: e["tag"] == "button" and e["text"].strip().lower() == "submit")
    return _centre(submit) if submit else None


def _focus_nth(fields: dict, elements: list[dict]) -> Optional[Action]:
    boxes = [e for e in elements if e["tag"] == "input_text"]
    n = int(fields.get("target", "1") or 1)
    return _centre(boxes[n - 1]) if 0 < n <= len(boxes) else None


EXPERTS: dict[str, Callable[[dict, list[dict]], Optional[Action]]] = {
    "click-button": _click(lambda e, f: e["tag"] == "button" and e["text"] == f.get("target")),
    "click-link": _click(lambda e, f: "alink" in e["classes"].split() and e["text"] == f.get("target")),
    "click-test": _click(lambda e, f: e["tag"] == "button"),
    "click-test-2": _click(lambda e, f: e["tag"] == "button" and e["text"] == f.get("target")),
    "click-tab": _click(lambda e, f: e["tag"] == "a" and e["text"] == f"Tab #{f.get('target')}"),
    "click-dialog": _click(lambda e, f: "ui-dialog-titlebar-close" in e["classes"].split()),
    "focus-text": _click(lambda e, f: e["tag"] == "input_text"),
    "focus-text-2": _focus_nth,
    "enter-text": _enter_text,
}


def expert_action(task: str, fields: dict, elements: list[dict]) -> Optional[Action]:
    """The next action a correct agent takes on this screen, or None (no expert for `task`, or stuck)."""
    fn = EXPERTS.get(task)
    return fn(fields, elements) if fn else None
