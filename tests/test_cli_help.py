"""Every command's --help: each option says what it does, each argument is named in the
text, and at least one example line (``k3ckpt CMD ...``) shows how it is called."""

from __future__ import annotations

import click
import pytest

from k3ckpt.cli.main import COMMANDS, cli, main

def _params():
    return sorted(COMMANDS)


def _command(name: str) -> click.Command:
    return cli.get_command(click.Context(cli, info_name="k3ckpt"), name)


def _help(capsys, *args) -> str:
    assert main([*args, "--help"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", _params())
def test_every_option_has_help(name):
    cmd = _command(name)
    missing = [p.opts[0] for p in cmd.params
               if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()]
    assert missing == [], f"k3ckpt {name}: options without help: {missing}"


@pytest.mark.parametrize("name", _params())
def test_every_argument_is_named_in_the_help(name):
    # click arguments take no help= text: the command's help names them (SRC, DST, ...)
    cmd = _command(name)
    text = cmd.help or ""
    missing = [p.human_readable_name for p in cmd.params
               if isinstance(p, click.Argument) and p.human_readable_name not in text]
    assert missing == [], f"k3ckpt {name}: arguments not named in its help: {missing}"


@pytest.mark.parametrize("name", _params())
def test_help_shows_an_example(capsys, name):
    lines = [line.strip() for line in _help(capsys, name).splitlines()]
    examples = [line for line in lines if line.startswith(f"k3ckpt {name}")]
    assert examples, f"k3ckpt {name} --help shows no example line starting 'k3ckpt {name}'"


def test_group_help_gives_examples_and_the_exit_status_rule(capsys):
    text = _help(capsys)
    lines = [line.strip() for line in text.splitlines()]
    assert any(line.startswith("k3ckpt demo ") for line in lines)
    assert any(line.startswith("k3ckpt inspect ") for line in lines)
    assert "0  success" in lines
    assert "1  a check failed (verify found a difference)" in lines
    assert "2  a mistake in the command or its input (one line on stderr: k3ckpt: error: ...)" in lines
    # the commands' table still follows, each command once
    for name in COMMANDS:
        assert sum(line.startswith(name + " ") for line in lines) == 1, name
