"""The MiniWoB++ DOM expert (envs/miniwob_expert.py) on hand-written screens: it reads the utterance, looks
at the DOM, and says the next action or why it has none. No browser needed."""

from __future__ import annotations

from trainfit.envs.cua_actions import Action
from trainfit.envs.miniwob_expert import advise


def el(tag, text="", box=(0, 0, 10, 10), value="", classes="", focused=False, id="", tampered=False):
    return {"ref": 1, "tag": tag, "text": text, "value": value, "id": id, "classes": classes, "box": list(box),
            "focused": focused, "tampered": tampered}


def act(utterance, screen, history=()):
    return advise(utterance, screen, history).action


def test_clicks_the_centre_of_the_named_button():
    screen = [el("button", "Okay", (2, 84, 47, 21)), el("button", "no", (2, 52, 30, 21))]
    # The centre of the button whose text is the target (left + width / 2, top + height / 2, truncated).
    assert act('Click on the "no" button.', screen) == Action("click", 17.0, 62.0)
    missing = advise('Click on the "yes" button.', screen)
    assert missing.action is None and 'no button "yes" on the screen' in missing.why


def test_an_utterance_it_does_not_read_gets_a_reason():
    got = advise("Playing as 'X', win a game of tic-tac-toe.", [el("button", "x")])
    assert got.action is None and "no instruction the expert reads matches" in got.why and "tic-tac-toe" in got.why
    declined = advise("Select words similar to pig and click Submit.", [])
    assert declined.action is None and "by their meaning" in declined.why


def test_fills_a_text_field_then_submits():
    box, submit = el("input_text", box=(5, 56, 128, 21)), el("button", "Submit", (5, 87, 95, 31))
    say = 'Enter "Jerald" into the text field and press Submit.'
    steps = [([box, submit], Action("click", 69.0, 66.0)),
             ([dict(box, focused=True), submit], Action("type", text="Jerald")),
             ([dict(box, focused=True, value="Jer"), submit], Action("key", text="C-a")),   # replace, not append
             ([dict(box, value="Jerald"), submit], Action("click", 52.0, 102.0))]
    for screen, want in steps:
        assert act(say, screen) == want
    upper = 'Type "agustina" in all upper case letters in the text input and press Submit.'
    assert act(upper, [dict(box, focused=True), submit]) == Action("type", text="AGUSTINA")


def test_login_fills_each_field_by_its_label():
    screen = [el("label", "Username", (2, 62, 48, 11)), el("input_text", box=(7, 78, 128, 21), id="username"),
              el("label", "Password", (2, 114, 47, 11)), el("input_password", box=(7, 130, 108, 21), id="password"),
              el("button", "Login", (2, 166, 86, 31))]
    say = 'Enter the username "karrie" and the password "AU" into the text fields and press login.'
    assert act(say, screen) == Action("click", 71.0, 88.0)
    screen[1].update(value="karrie")
    assert act(say, screen) == Action("click", 61.0, 140.0)           # the password field next
    screen[3].update(focused=True)
    assert act(say, screen) == Action("type", text="AU")
    screen[3].update(value="AU")
    assert act(say, screen) == Action("click", 45.0, 181.0)           # Login


def test_ticks_exactly_the_named_checkboxes():
    def screen(checked):
        out = []
        for i, name in enumerate(["AU", "HF2", "q"]):
            out += [el("label", box=(2, 59 + 19 * i, 40, 11)),
                    el("input_checkbox", box=(6, 55 + 19 * i, 20, 13), value="True" if name in checked else ""),
                    el("t", name, (29, 59 + 19 * i, 13, 11))]
        return out + [el("button", "Submit", (2, 120, 95, 31))]

    say = "Select HF2, q and click Submit."
    assert act(say, screen({"AU"})) == Action("click", 16.0, 61.0)         # untick AU first
    assert act(say, screen({"HF2"})) == Action("click", 16.0, 99.0)        # then tick q
    assert act(say, screen({"HF2", "q"})) == Action("click", 49.0, 135.0)  # Submit
    assert act("Select nothing and click Submit.", screen(set())) == Action("click", 49.0, 135.0)
    assert "no checkbox labelled zz" in advise("Select zz and click Submit.", screen(set())).why


def test_chooses_from_a_drop_down_list_by_typing_the_option():
    select, submit = el("select", box=(2, 57, 150, 19)), el("button", "Submit", (2, 81, 95, 31))
    say = "Select Helli from the list and click Submit."
    assert act(say, [select, submit]) == Action("click", 77.0, 66.0)
    assert act(say, [dict(select, focused=True), submit]) == Action("type", text="Helli")
    # The DOM does not show a closed list's choice: what was typed is read from the episode's history.
    assert act(say, [dict(select, focused=True), submit], [Action("type", text="Helli")]) == Action("click", 49.0, 96.0)


def test_a_sequence_goes_on_once_its_first_click_happened():
    one, two = el("button", "ONE", (4, 60, 40, 40)), el("button", "TWO", (69, 112, 40, 40))
    say = "Click button ONE, then click button TWO."
    assert act(say, [one, two]) == Action("click", 24.0, 80.0)
    assert act(say, [dict(one, tampered=True), two]) == Action("click", 89.0, 132.0)


def test_opens_folders_until_the_file_shows():
    say = 'Navigate through the file tree. Find and click on the folder or file named "Briana".'
    olin = el("span", "Olin", (18, 83, 140, 13))
    closed = [el("div", box=(2, 83, 16, 16), classes="hitarea expandable-hitarea"), olin]
    assert act(say, closed) == Action("click", 10.0, 91.0)
    opened = [el("div", box=(2, 83, 16, 16), classes="hitarea collapsable-hitarea"), olin,
              el("span", "Briana", (34, 98, 124, 13))]
    assert act(say, opened) == Action("click", 96.0, 104.0)
    assert "no closed folder left" in advise(say, opened[:2]).why


def test_clicks_where_nothing_covers_the_target():
    # TWO is drawn after ONE and over its centre (24, 80): the click goes to ONE's nearest uncovered pixel.
    one, two = el("button", "ONE", (4, 60, 40, 40)), el("button", "TWO", (20, 70, 40, 40))
    assert act("Click button ONE.", [one, two]) == Action("click", 19.0, 80.0)   # one pixel left of TWO
    hidden = advise("Click button ONE.", [one, el("button", "TWO", (0, 50, 60, 60))])
    assert hidden.action is None and "covered" in hidden.why
