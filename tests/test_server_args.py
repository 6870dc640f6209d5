"""ServerArgs on the command line: every option parses to its declared type, and an option whose type has no
parser is an error at definition time rather than a string in disguise."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from radixrt.server_args import ServerArgs

SAMPLE = {int: "7", float: "2.5", str: "x"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_every_option_parses_to_its_declared_type():
    argv, expected = [], {}
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind == "bool":
            argv.append(flag)
            expected[f.name] = True
            continue
        base = {"int": int, "float": float, "str": str}[kind.split(" | ")[0]]
        argv += [flag, SAMPLE[base]]
        expected[f.name] = base(SAMPLE[base])
    args = ServerArgs.from_cli_args(_parser().parse_args(argv))
    for name, value in expected.items():
        got = getattr(args, name)
        assert got == value and type(got) is type(value), (name, got)


def test_defaults_survive_the_command_line():
    assert ServerArgs.from_cli_args(_parser().parse_args([])) == ServerArgs()


def test_an_option_type_without_a_parser_is_refused():
    @dataclasses.dataclass
    class Odd(ServerArgs):
        odd: "list[int] | None" = None

    with pytest.raises(TypeError, match="odd"):
        Odd.add_cli_args(argparse.ArgumentParser())
