"""Computer-use action parsing (envs/cua_actions.py): no browser needed (the expert's tests on hand-written
screens are in test_cua_expert.py)."""

from __future__ import annotations

import pytest

from trainfit.envs.cua_actions import Action, ParseError, parse_action

W, H = 160, 210


@pytest.mark.parametrize("text, want", [
    ("click(12, 40)", Action("click", 12.0, 40.0)),
    ("I see the OK button.\nclick(12.5, 40)", Action("click", 12.5, 40.0)),
    ("double_click(0, 0)", Action("double_click", 0.0, 0.0)),
    ('type("Jerald")', Action("type", text="Jerald")),
    ("type('a) b')", Action("type", text="a) b")),            # a ")" inside the string is not the end
    ('type(text="hi")', Action("type", text="hi")),
    ("click(y=2, x=1)", Action("click", 1.0, 2.0)),          # named arguments bind by name
    ('key("Enter")', Action("key", text="<Enter>")),
    ('key("ctrl+a")', Action("key", text="C-a")),
    ('key("x")', Action("key", text="x")),
    ('scroll(80, 100, "up")', Action("scroll", 80.0, 100.0, "up")),
    ("scroll(80, 100)", Action("scroll", 80.0, 100.0, "down")),
    ("done()", Action("done")),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [3, 4]}}</tool_call>',
     Action("click", 3.0, 4.0)),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "key", "keys": ["ctrl", "a"]}}</tool_call>',
     Action("key", text="C-a")),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "scroll", "coordinate": [5, 6], "pixels": 100}}'
     "</tool_call>", Action("scroll", 5.0, 6.0, "up")),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "terminate", "status": "success"}}</tool_call>',
     Action("done")),
])
def test_valid_actions(text, want):
    assert parse_action(text, W, H) == want


@pytest.mark.parametrize("text, says", [
    ("I will click the button", "no action found"),
    ("click(160, 10)", "outside the screen: x must be in [0, 160)"),
    ("click(5, -1)", "outside the screen"),
    ("click(5)", "needs two numbers"),
    ("click(1, 2) click(3, 4)", "one action per turn, got 2"),
    ("click(1, 2", "not closed"),
    ('type("")', "non-empty string"),
    (f'type("{"a" * 65}")', "at most 64 characters"),
    ('key("Hyper")', "unknown key"),
    ('scroll(1, 2, "left")', 'must be "up" or "down"'),
    ("click(a, b)", "numbers or quoted strings"),
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ("<tool_call>{}", "not closed"),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "right_click", "coordinate": [1, 1]}}</tool_call>',
     "not supported here"),
])
def test_malformed_actions_say_what_is_wrong(text, says):
    got = parse_action(text, W, H)
    assert isinstance(got, ParseError) and says in got.message, got


def test_render_round_trips():
    for a in (Action("click", 12.0, 40.0), Action("type", text='say "hi"'), Action("key", text="<Enter>"),
              Action("key", text="C-a"), Action("scroll", 1.0, 2.0, "up"), Action("done"),
              Action("double_click", 3.5, 4.0)):
        assert parse_action(a.render(), W, H) == a


def test_serve_without_a_browser_exits_2_naming_the_os_packages(monkeypatch):
    from typer.testing import CliRunner

    from trainfit.app.cli import app

    monkeypatch.setenv("MINIWOB_CHROME_BINARY", "/nonexistent/chromium")
    monkeypatch.setenv("MINIWOB_CHROMEDRIVER", "/nonexistent/chromedriver")
    r = CliRunner().invoke(app, ["env", "serve", "miniwob", "--tasks", "click-button", "--port", "0"])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "Traceback" not in out
    assert "chromium and chromedriver not found" in out and "apt-get install chromium chromium-driver" in out
    r = CliRunner().invoke(app, ["env", "serve", "desktop"])
    assert r.exit_code == 2 and "the environments served are: miniwob" in " ".join(r.output.split())


def test_missing_miniwob_package_names_the_extra(monkeypatch):
    import sys

    from trainfit.envs.miniwob_browser import MissingDependency, import_miniwob

    monkeypatch.setitem(sys.modules, "miniwob", None)   # as if not installed
    with pytest.raises(MissingDependency, match=r"needs the `miniwob` package: `pip install 'trainfit\[miniwob\]'`"):
        import_miniwob()
