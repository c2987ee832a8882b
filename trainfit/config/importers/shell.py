"""Reading the launch scripts the peers ship (verl's run_*.sh, OpenRLHF's train_*.sh) or one pasted command
into the words of each command, as bash would pass them.

Only what those scripts use is understood: comments, line continuations, `NAME=value` and `export NAME=value`,
bash arrays `NAME=( ... )` (one word or comment a line), `read -r -d '' NAME <<EOF ... EOF` here-documents,
and `$NAME`, `${NAME}`, `${NAME[@]}`, `${NAME:-default}` expansions. `$HOME` is written `~` (trainfit expands
it where it reads a path); a variable the script does not set stays as written. Nothing is run.
"""

from __future__ import annotations

import re
import shlex

from trainfit.config.base import ConfigError

_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_HEREDOC = re.compile(r"^read\s+.*?([A-Za-z_][A-Za-z0-9_]*)\s*<<\s*'?\"?(\w+)'?\"?\s*$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(\[@\])?(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*|@)")


def commands(text: str) -> list[list[str]]:
    """The words of each command line of a script (or of one command), variables expanded."""
    env: dict[str, str] = {"HOME": "~"}
    out: list[list[str]] = []
    lines = _joined(text)
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        m = _HEREDOC.match(line)
        if m:
            body = []
            while i < len(lines) and lines[i].strip() != m.group(2):
                body.append(lines[i])
                i += 1
            i += 1
            env[m.group(1)] = _expand(" ".join(body), env)
            continue
        m = _ASSIGN.match(line)
        if m and m.group(2).startswith("(") and not m.group(2).rstrip().endswith(")"):   # a bash array
            body = []
            while i < len(lines) and lines[i].strip() != ")":
                body += _words(_expand(lines[i], env))
                i += 1
            i += 1
            env[m.group(1)] = shlex.join(body)
            continue
        if m and "$(" in m.group(2):   # a command's output: unknown here, so $NAME stays as written
            continue
        if m:
            value = _words(_expand(m.group(2), env))
            env[m.group(1)] = value[0] if len(value) == 1 else " ".join(value)
            continue
        words = _words(_expand(line, env))
        if words:
            out.append(words)
    return out


def _joined(text: str) -> list[str]:
    """Lines with their backslash continuations joined (a comment line inside a continued command ends it,
    as in bash)."""
    out: list[str] = []
    buf = ""
    for raw in text.splitlines():
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        out.append(buf + raw)
        buf = ""
    if buf:
        out.append(buf)
    return out


def _expand(s: str, env: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        if name == "@":
            return ""
        if name in env:
            return env[name]
        if m.group(3) is not None:
            return m.group(3)
        return m.group(0)
    return _VAR.sub(one, s)


def _words(s: str) -> list[str]:
    try:
        return shlex.split(s, comments=True)
    except ValueError as e:
        raise ConfigError(f"cannot read the command {s.strip()[:120]!r}: {e} (an unclosed quote?); paste the command "
                          "with its quotes balanced.") from None
