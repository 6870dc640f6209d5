"""Fuzz a `radixrt serve` from its own OpenAPI document (GET /openapi.json) with schemathesis.

    python -m radixrt.bench.fuzz_http --max-examples 100                 # starts a server (float32)
    python -m radixrt.bench.fuzz_http --url http://127.0.0.1:30000 --max-examples 100

For every operation (but the profiler's, the LoRA loads', the updates of weights', the pauses' and the memory releases', ``NOT_FUZZED``) it sends ``--max-examples`` bodies that fit the schema
(positive) and as many that break it (negative), one at a time, and checks: every one of schemathesis's checks
on every answer (no 5xx, status codes, content types and bodies as the document declares them, negative data
refused, positive data accepted, ...), every answer within ``--timeout`` seconds (else a hang), and afterwards
/health is 200 and a greedy /generate returns what it returned before the run.
Cases stay cheap: ``bounded_schema`` caps token counts, ``n``, top-logprobs and array lengths below the
server's real bounds, and ``cap_cost`` gives a small token budget to bodies that leave it to the default.
Prints the operations, cases tried, status-code counts, every 5xx (with a curl command) and every hang.
Exit code 0 when there were no 5xx and no hangs and the server still serves correctly.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

TOKEN_COUNTS = ("max_new_tokens", "min_new_tokens", "max_tokens", "max_completion_tokens", "min_tokens")
# The profiler's routes write trace files into whatever folder a body names: fuzzing them would write files
# all over the machine. tests/test_server_profile.py covers them. A LoRA load reads whatever path (or hub id) a
# body names, and no generated body names a real adapter; tests/test_lora_serving.py covers both LoRA routes. An
# update of weights reads whatever path a body names too, and a pause (SGLang's or vLLM's) would hold every later
# case until a continue; tests/test_weight_update.py covers those. So would memory released (SGLang's release, vLLM's
# sleep) until resumed; tests/test_memory_release.py covers those routes. Joining a weight group waits for a trainer at whatever address a
# body names; tests/test_weight_broadcast.py covers it.
NOT_FUZZED = frozenset({"/start_profile", "/stop_profile", "/load_lora_adapter", "/unload_lora_adapter",
                        "/update_weights_from_disk", "/pause_generation", "/continue_generation",
                        "/init_weights_update_group", "/pause", "/resume", "/release_memory_occupation",
                        "/resume_memory_occupation", "/sleep", "/wake_up"})
SERVER_ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.05", "--context-length", "512", "--log-interval", "0"]
REFERENCE = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                      "ignore_eos": True}}


@dataclass
class FuzzReport:
    operations: list[str] = field(default_factory=list)
    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # a 5xx answer: status, curl, body
    check_failures: list[str] = field(default_factory=list)  # any other schemathesis check that failed
    hangs: list[str] = field(default_factory=list)  # no answer within the timeout, or the connection failed
    healthy_after: bool = False
    same_output_after: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (not self.server_errors and not self.check_failures and not self.hangs and self.healthy_after
                and self.same_output_after)

    def render(self) -> str:
        lines = [f"operations ({len(self.operations)}): {', '.join(self.operations)}",
                 f"cases tried: {self.cases} in {self.seconds:.1f} s",
                 "status codes: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items())),
                 f"5xx answers: {len(self.server_errors)}", *("  " + e for e in self.server_errors),
                 f"other check failures: {len(self.check_failures)}", *("  " + e for e in self.check_failures),
                 f"hangs: {len(self.hangs)}", *("  " + h for h in self.hangs),
                 f"healthy after: {self.healthy_after}; same greedy output after: {self.same_output_after}"]
        return "\n".join(lines)


def bounded_schema(doc: dict[str, Any], max_tokens: int = 4, max_items: int = 3, max_n: int = 2,
                   max_top: int = 3, max_string: int = 48) -> dict[str, Any]:
    """A copy of the server's document whose limits keep every accepted case to a few tokens of work."""
    doc = copy.deepcopy(doc)
    caps = {**{name: max_tokens for name in TOKEN_COUNTS}, "n": max_n, "best_of": max_n,
            "top_logprobs_num": max_top, "top_logprobs": max_top, "logprobs": max_top}

    def cap(node: Any, name: str | None = None) -> None:
        if isinstance(node, list):
            for item in node:
                cap(item, name)
            return
        if not isinstance(node, dict):
            return
        if node.get("type") == "integer" and name in caps:
            node["maximum"] = min(node.get("maximum", caps[name]), caps[name])
        if node.get("type") == "array":
            node["maxItems"] = min(node.get("maxItems", max_items), max_items)
        if node.get("type") == "string":
            node["maxLength"] = min(node.get("maxLength", max_string), max_string)
        for key, value in node.items():
            if key == "properties":
                for prop, sub in value.items():
                    cap(sub, prop)
            elif key in ("anyOf", "oneOf", "allOf", "items"):
                cap(value, name)

    for name, schema in doc["components"]["schemas"].items():
        if not name.startswith("Error"):  # the bodies of answers keep their real bounds: only requests are capped
            cap(schema)
    # Positive cases keep to rules between fields that JSON Schema cannot say: a list of sampling params has one
    # entry per prompt; best_of equals n ...
    schemas = doc["components"]["schemas"]
    params = schemas["GenerateBody"]["properties"]["sampling_params"]
    params["anyOf"] = [b for b in params["anyOf"] if b.get("type") != "array"]
    labels = schemas["GenerateBody"]["properties"]["token_ids_logprob"]  # one list of ids for every prompt
    labels["anyOf"] = [labels["anyOf"][0], {"type": "null"}]
    if "best_of" in schemas["CompletionRequest"]["properties"]:
        schemas["CompletionRequest"]["properties"]["best_of"] = {"type": "null"}
    # ... one rid per request (of n samples of each prompt); tools whose parameters are JSON schemas of objects (which a schema of schemas
    # cannot pin down), and a tool_choice that names one of them
    for name in ("GenerateBody", "CompletionRequest", "ChatCompletionRequest", "EncodeBody"):
        schemas[name]["properties"]["rid"] = {"type": "null"}
    # ... and one adapter or cache key per prompt: /encode's and /generate's as one for all
    for field in ("lora_path", "extra_key", "cache_salt"):
        for body in ("EncodeBody", "GenerateBody"):
            schemas[body]["properties"][field] = {"anyOf": [{"type": "string", "maxLength": max_string},
                                                            {"type": "null"}]}
    schemas["ChatCompletionRequest"]["properties"]["tools"] = {"type": "null"}
    schemas["ChatCompletionRequest"]["properties"]["tool_choice"] = {"type": "null"}
    # ... a stream of one prompt with n = 1; one constraint at most, a regex that compiles, a JSON schema that parses,
    # no stop regex (a random pattern may not compile, or may match the empty string), no logit bias (a random
    # token id may lie past the vocabulary)
    schemas["GenerateBody"]["properties"]["stream"] = {"const": False}
    for name in ("SamplingParams", "CompletionRequest", "ChatCompletionRequest"):
        for field in ("regex", "json_schema", "choices", "ebnf", "stop_regex", "logit_bias"):
            if field in schemas[name]["properties"]:
                schemas[name]["properties"][field] = {"type": "null"}
    return doc


def cap_cost(path: str, body: Any, max_tokens: int = 4) -> None:
    """Give a small token budget to a body that leaves it to the server's default (up to the context)."""
    if not isinstance(body, dict):
        return
    if path == "/generate":
        params = body.get("sampling_params")
        if params is None:
            body["sampling_params"] = {"max_new_tokens": max_tokens}
        for one in params if isinstance(params, list) else [params]:
            if isinstance(one, dict):
                one.setdefault("max_new_tokens", max_tokens)
    elif path == "/v1/chat/completions":
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = max_tokens
    elif path == "/v1/completions":
        if body.get("max_tokens") is None:
            body["max_tokens"] = max_tokens


def reference_output(client: httpx.Client) -> list[int] | None:
    client.post("/flush_cache")  # a cold cache, as at the start: the same computation both times
    res = client.post("/generate", json=REFERENCE)
    return res.json().get("output_ids") if res.status_code == 200 else None


def run_fuzz(url: str, max_examples: int = 10, timeout: float = 30.0, seed: int = 0,
             modes: tuple[str, ...] = ("positive", "negative")) -> FuzzReport:
    import hypothesis
    import requests
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import CHECKS

    report = FuzzReport()
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=timeout) as client:
        doc = client.get("/openapi.json").json()
        before = reference_output(client)
    config = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})
    # Positive cases come from a copy whose bounds keep them cheap; negative ones from the document itself, since
    # a bound tighter than the server's would make it "accept invalid data" between the two.
    schemas = {"positive": schemathesis.openapi.from_dict(bounded_schema(doc), config=config),
               "negative": schemathesis.openapi.from_dict(doc, config=config)}
    session = requests.Session()

    def call(case) -> None:
        cap_cost(case.path, case.body)
        report.cases += 1
        try:
            response = case.call(base_url=url, session=session, timeout=timeout)
        except requests.RequestException as exc:
            report.hangs.append(f"{type(exc).__name__}: {case.as_curl_command(base_url=url)}")
            return
        report.statuses[response.status_code] += 1
        if response.status_code >= 500:
            report.server_errors.append(f"{response.status_code} {case.as_curl_command(base_url=url)} -> "
                                        f"{response.text[:300]}")
            return
        try:
            case.validate_response(response, checks=CHECKS.get_all())
        except (Exception, BaseExceptionGroup) as exc:  # a failure (group) naming each check that failed
            report.check_failures.append(f"{_failure_names(exc)}: {response.status_code} "
                                         f"{case.as_curl_command(base_url=url)} -> {response.text[:200]}")

    for mode in modes:
        for result in schemas[mode].get_all_operations():
            operation = result.ok()
            if operation.path in NOT_FUZZED:
                continue
            name = f"{operation.method.upper()} {operation.path}"
            if name not in report.operations:
                report.operations.append(name)
            try:
                strategy = operation.as_strategy(generation_mode=GenerationMode(mode))
            except Exception:  # nothing to break in an operation without parameters or body
                continue

            @hypothesis.seed(seed)
            @hypothesis.settings(max_examples=max_examples, deadline=None, database=None,
                                 phases=[hypothesis.Phase.generate], suppress_health_check=list(hypothesis.HealthCheck),
                                 verbosity=hypothesis.Verbosity.quiet)
            @hypothesis.given(strategy)
            def fuzz_one(case) -> None:
                call(case)

            try:
                fuzz_one()
            except hypothesis.errors.Unsatisfiable:
                pass
    with httpx.Client(base_url=url, timeout=timeout) as client:
        try:
            report.healthy_after = client.get("/health").status_code == 200
            report.same_output_after = before is not None and reference_output(client) == before
        except httpx.HTTPError:
            report.healthy_after = False
    report.seconds = time.monotonic() - started
    return report


def _failure_names(exc: BaseException) -> str:
    failures = getattr(exc, "exceptions", None) or [exc]
    return "; ".join(sorted({f"{getattr(f, 'title', None) or type(f).__name__} ({str(getattr(f, 'message', '') or '')[:160]})"
                             for f in failures}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--max-examples", type=int, default=100, help="cases per operation and mode")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds an answer may take before it is a hang")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=["all", "positive", "negative"], default="all")
    parser.add_argument("server_args", nargs="*", help="extra `radixrt serve` arguments (after --)")
    args = parser.parse_args(argv)
    modes = ("positive", "negative") if args.mode == "all" else (args.mode,)
    if args.url:
        report = run_fuzz(args.url, args.max_examples, args.timeout, args.seed, modes)
    else:
        from radixrt.server.server_process import ServerProcess

        with ServerProcess(SERVER_ARGS + args.server_args) as server:
            report = run_fuzz(server.url, args.max_examples, args.timeout, args.seed, modes)
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
