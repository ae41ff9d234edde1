"""The `fastrlhf` entry point dispatches to each stage's module."""

import subprocess
import sys

from fastrlhf import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out


def test_unknown_command_is_an_error(capsys):
    assert cli.main(["train"]) == 2
    assert "unknown command 'train'" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "fastrlhf", "--version"], capture_output=True, text=True, check=True)
    from fastrlhf import __version__

    assert proc.stdout.strip() == __version__
