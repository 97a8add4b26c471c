"""``linattn COMMAND --help``: plain text (no reST markup, no router internals), a description,
and a help text for every option and argument."""

from __future__ import annotations

import re

import pytest

from linattn.cli import main

COMMANDS = [
    ["simulate"], ["simulate", "run"], ["simulate", "validate"], ["simulate", "bench"],
    ["reproduce"], ["figure"],
    ["run"], ["sweep"], ["study"], ["pretrain"], ["profile"],
    ["data"], ["data", "list"], ["data", "fetch"], ["data", "pack"], ["data", "partition"],
]
MARKUP = ("``", ":func:", ":class:", ":mod:", ":meth:", ":attr:")
INTERNALS = ("router", "argv", "linattn/cli.py")


def help_text(argv: list[str], capsys) -> str:
    try:
        code = main([*argv, "--help"])
    except SystemExit as exc:
        code = exc.code
    assert code in (0, None), argv
    return capsys.readouterr().out


def undocumented(text: str) -> list[str]:
    """Entries of the help's argument lists that have no text of their own.

    An entry (indented 2 or 4 spaces under a ``title:`` line) is documented when its line goes
    on after two or more spaces, or when the next line is a continuation indented deeper.
    """
    lines = text.splitlines()
    bad, in_list = [], False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        if not line.startswith(" "):
            in_list = line.endswith(":") and not line.startswith("usage:")
            continue
        indent = len(line) - len(line.lstrip())
        if not in_list or indent > 4:
            continue
        if re.search(r"\S {2,}\S", line.strip()):
            continue
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if following.strip() and len(following) - len(following.lstrip()) > indent + 2:
            continue
        bad.append(line.strip())
    return bad


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_help_is_plain_text_with_every_option_explained(argv, capsys):
    text = help_text(argv, capsys)
    assert text.startswith("usage: linattn " + " ".join(argv))
    for mark in MARKUP + INTERNALS:
        assert mark not in text, (mark, text)
    description = text.split("\n\n")[1]
    assert len(description.split()) >= 5 and not description.startswith(" "), text
    assert undocumented(text) == [], text


def test_the_checker_finds_an_option_without_help():
    text = ("usage: x\n\nA tool that does a thing.\n\noptions:\n"
            "  -h, --help  show this help message and exit\n  --seed SEED\n"
            "  --long-option-name LONG_OPTION_NAME\n                        explained here\n")
    assert undocumented(text) == ["--seed SEED"]
