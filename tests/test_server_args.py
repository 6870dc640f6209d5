"""ServerArgs on the command line and as keyword arguments: every option parses to its declared type; SGLang's
launch flags by their names (aliases), fixed-choice options with their choices, one default in each help; an
option whose type has no parser is an error at definition time rather than a string in disguise."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from radixrt import server_args as sa
from radixrt.server_args import ServerArgs

SAMPLE = {int: "7", float: "2.5", str: "x"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _sample(f: dataclasses.Field) -> tuple[str, object] | None:
    """A value the option takes on the command line, and what it parses to (None: it takes none but its
    default)."""
    choices, refused = f.metadata.get("choices"), f.metadata.get("refused")
    if choices is not None:
        pick = next(c for c in choices if c != f.default)
        return pick, pick
    if refused is not None:
        allowed = [v for v in refused[1] if v is not None]
        return (str(allowed[0]), allowed[0]) if allowed else None
    if str(f.type).startswith("list[str]"):
        return SAMPLE[str], [SAMPLE[str]]
    base = {"int": int, "float": float, "str": str}[str(f.type).split(" | ")[0]]
    return SAMPLE[base], base(SAMPLE[base])


def test_every_option_parses_to_its_declared_type():
    argv, expected = [], {}
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "enable_deterministic_inference":  # refuses the CUDA device picked below (test_deterministic.py)
            continue
        if f.name in ("lora_paths", "enable_lora"):  # refuse the tensor parallelism picked below (test_lora.py)
            continue
        if f.name == "json_model_override_args":  # a JSON object (test_model_overrides_are_a_json_object)
            argv += [flag, '{"is_matryoshka": true}']
            expected[f.name] = '{"is_matryoshka": true}'
            continue
        if str(f.type) == "bool":
            if "refused" not in f.metadata:
                argv.append(flag)
                expected[f.name] = True
            continue
        sample = _sample(f)
        if sample is None:
            continue
        text, value = sample
        argv += [flag, text]
        expected[f.name] = value
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


# ----- SGLang's flags -------------------------------------------------------------------------------------


SGLANG_LAUNCH = ["--model-path", "/models/m", "--port", "31000", "--host", "0.0.0.0", "--tp", "2", "--dp-size", "1",
                 "--mem-fraction-static", "0.7", "--max-total-tokens", "4096", "--chat-template", "t.jinja",
                 "--log-level", "warning", "--trust-remote-code", "--context-length", "2048",
                 "--max-running-requests", "32", "--chunked-prefill-size", "-1", "--served-model-name", "m",
                 "--enable-metrics", "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25",
                 "--attention-backend", "torch_native", "--dtype", "half", "--kv-cache-dtype", "auto",
                 "--watchdog-timeout", "600", "--schedule-conservativeness", "1.3", "--stream-interval", "8",
                 "--skip-server-warmup", "--is-embedding", "--disable-cuda-graph", "--cuda-graph-max-bs", "8",
                 "--random-seed", "1", "--nccl-init-addr", "h:1", "--max-prefill-tokens", "16384",
                 "--schedule-policy", "fcfs", "--disable-radix-cache", "--load-format", "auto", "--enable-memory-saver"]


def test_an_sglang_launch_command_line_parses():
    args = ServerArgs.from_cli_args(_parser().parse_args(SGLANG_LAUNCH))
    assert (args.model, args.port, args.host, args.tp_size, args.dp_size) == ("/models/m", 31000, "0.0.0.0", 2, 1)
    assert (args.mem_fraction_static, args.max_total_tokens, args.chat_template) == (0.7, 4096, "t.jinja")
    assert (args.log_level, args.trust_remote_code, args.chunked_prefill_size) == ("warning", True, -1)
    assert (args.reasoning_parser, args.tool_call_parser, args.attention_backend) == ("qwen3", "qwen25",
                                                                                      "torch_native")
    assert (args.dist_init_addr, args.dtype, args.is_embedding) == ("h:1", "half", True)


@pytest.mark.parametrize("flag,name,value", [
    ("--tp", "tp_size", 4), ("--tensor-parallel-size", "tp_size", 4), ("--tp-size", "tp_size", 4),
    ("--dp", "dp_size", 3), ("--data-parallel-size", "dp_size", 3), ("--model-path", "model", "x"),
    ("--model", "model", "x"), ("--nccl-init-addr", "dist_init_addr", "x"),
])
def test_aliases_set_their_option(flag, name, value):
    assert getattr(ServerArgs.from_cli_args(_parser().parse_args([flag, str(value)])), name) == value


def test_keyword_arguments_take_sglang_names_too():
    args = ServerArgs.from_kwargs(model_path="m", tp=2, dp_size=1, mem_fraction_static=0.5, log_level="error")
    assert (args.model, args.tp_size, args.mem_fraction_static, args.log_level) == ("m", 2, 0.5, "error")
    with pytest.raises(TypeError, match="given twice"):
        ServerArgs.from_kwargs(model="a", model_path="b")
    with pytest.raises(TypeError, match="no_such_option"):
        ServerArgs.from_kwargs(no_such_option=1)


def test_an_abbreviation_is_not_a_flag():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--kv-memory", "1"])


def test_a_choice_outside_the_list_fails_when_parsed():
    for flag in ("--dtype", "--device", "--attention-backend", "--schedule-policy", "--tool-call-parser",
                 "--reasoning-parser", "--log-level"):
        with pytest.raises(SystemExit):
            _parser().parse_args([flag, "no-such-choice"])
    with pytest.raises(ValueError, match="dtype must be one of"):
        ServerArgs(dtype="bf15")


@pytest.mark.parametrize("options,what", [
    ({"kv_cache_dtype": "fp8_e4m3"}, "KV cache dtype"),
    ({"tokenizer_mode": "slow"}, "slow"),
    ({"skip_tokenizer_init": True}, "tokenizer"), ({"revision": "v2"}, "revision"),
])
def test_sglang_options_radixrt_does_not_serve_are_refused_by_name(options, what):
    with pytest.raises(ValueError, match=f"{next(iter(options))}=.*{what}"):
        ServerArgs(**options)


def test_model_overrides_are_a_json_object():
    assert ServerArgs().model_overrides() == {} and ServerArgs(json_model_override_args="").model_overrides() == {}
    args = ServerArgs(json_model_override_args='{"is_matryoshka": true, "rms_norm_eps": 1e-3}')
    assert args.model_overrides() == {"is_matryoshka": True, "rms_norm_eps": 1e-3}
    with pytest.raises(ValueError, match="not JSON"):
        ServerArgs(json_model_override_args="{is_matryoshka}")
    with pytest.raises(ValueError, match="JSON object"):
        ServerArgs(json_model_override_args="[1]")


def test_quantization_takes_fp8_and_refuses_other_methods_by_name():
    assert ServerArgs(quantization="fp8").quantization == "fp8"
    for method in ("awq", "gptq", "w8a8_int8"):
        with pytest.raises(ValueError, match=f"quantization must be one of fp8; got '{method}'"):
            ServerArgs(quantization=method)


def test_fixed_choice_lists_match_the_modules_that_act_on_them():
    from radixrt.model.attention import ATTENTION_BACKENDS
    from radixrt.model.runner import DTYPES
    from radixrt.reasoning import REASONING_FORMATS
    from radixrt.scheduler.policy import POLICIES
    from radixrt.server.openai_tools import PARSER_ALIASES

    assert set(sa.DTYPES) == {"auto", *DTYPES}
    assert set(sa.ATTENTION_BACKENDS) == set(ATTENTION_BACKENDS)
    assert set(sa.SCHEDULE_POLICIES) == set(POLICIES)
    assert set(sa.TOOL_CALL_PARSERS) == set(PARSER_ALIASES)
    assert set(sa.REASONING_PARSERS) == set(REASONING_FORMATS)


def test_every_flag_has_help_with_at_most_one_default():
    parser = _parser()
    for action in parser._actions:  # argparse's list of the flags it knows
        if action.dest == "help":
            continue
        assert action.help, action.dest
        assert action.help.count("default") <= 1, (action.dest, action.help)
    text = parser.format_help()
    assert "(default: None)" not in text
    assert "accepted with no effect" in text and "--mem-fraction-static" in text


def test_a_chunked_prefill_size_of_minus_one_prefills_a_whole_prompt_in_one_step():
    from radixrt.bench.sim.fake_runner import FakeRunner
    from radixrt.bench.sim.oracle import DeltaSink
    from radixrt.protocol.messages import GenerateReq
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.scheduler import Scheduler

    runner = FakeRunner(64, list(range(2, 60)), 1, 4, 256, context_length=512)
    args = ServerArgs(page_size=4, max_total_pages=256, chunked_prefill_size=-1, log_interval=0)
    scheduler = Scheduler(args, runner, None, {1}, DeltaSink())
    assert scheduler.args.chunked_prefill_size == 512
    prompt = [2 + i % 50 for i in range(300)]
    scheduler.submit(GenerateReq(rid="r", input_ids=prompt, params=SamplingParams(max_new_tokens=2)))
    scheduler.step()
    assert scheduler.running[0].num_computed == 300
    with pytest.raises(ValueError, match="-1"):
        Scheduler(ServerArgs(page_size=4, max_total_pages=256, chunked_prefill_size=0), runner, None, {1},
                  DeltaSink())


def test_mem_fraction_static_sizes_the_pool_from_the_memory_left_for_it(monkeypatch):
    import torch

    from radixrt.memory import page_pool

    monkeypatch.setattr(page_pool, "available_memory_bytes", lambda: 10 * 2**30)
    assert page_pool.fraction_budget_bytes(torch.device("cpu"), 0.25) == int(2.5 * 2**30)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        page_pool.fraction_budget_bytes(torch.device("cpu"), 1.5)
