"""The `radixrt` command guides a newcomer: help on a bare `radixrt`, `--version`, help on every flag of every
command, choices on fixed-choice flags, and a refused value named before anything loads."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import radixrt
from radixrt.cli import build_parser, main


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_a_bare_radixrt_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("fetch-model", "generate", "serve", "bench", "env"):
        assert command in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"radixrt {radixrt.__version__}"


@pytest.mark.parametrize("command", ["fetch-model", "generate", "serve"])
def test_every_flag_of_a_command_has_help(command):
    parser = _commands()[command]
    assert parser.description
    for action in parser._actions:
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"


def test_generate_takes_the_model_by_sglang_name_and_its_dtype_from_a_list():
    parser = _commands()["generate"]
    args = parser.parse_args(["hi", "--model-path", "m", "--dtype", "half"])
    assert (args.model, args.dtype) == ("m", "half")
    with pytest.raises(SystemExit):
        parser.parse_args(["hi", "--dtype", "bf15"])


def test_serve_names_a_refused_value_before_loading_anything(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--kv-cache-dtype", "fp8_e4m3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "kv_cache_dtype='fp8_e4m3'" in err and "does not serve a KV cache dtype" in err
    assert err.count("\n") < 5  # a short usage line, not every flag


def test_launch_server_takes_sglang_s_command_line():
    out = subprocess.run([sys.executable, "-m", "radixrt.launch_server", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--model-path", "--tp-size", "--tp", "--dp-size", "--mem-fraction-static", "--max-total-tokens",
                 "--chat-template", "--log-level", "--trust-remote-code", "--reasoning-parser"):
        assert f"{flag} " in out.stdout or f"{flag}," in out.stdout, flag
    bad = subprocess.run([sys.executable, "-m", "radixrt.launch_server", "--kv-cache-dtype", "fp8_e5m2"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "KV cache dtype" in bad.stderr
