"""Speculative decoding on and off over the same workloads (``radixrt.bench.spec_workloads``).

    radixrt bench spec [--workloads extraction,extraction-series,agent,refine,random] [--batch-sizes 1,8]
                       [--max-new-tokens 128] [--repeats 3] [--history cold|warm] [--dtype auto]
                       [--vllm-python PATH] [--json FILE] [--compare-unweighted] [--requests-per-slot 1]

One Engine started with ``--speculative-algorithm NGRAM``; each run switches speculation on or off after
flushing the radix cache. ``--history cold`` (the default): each run with speculation gets a fresh Speculator,
so it drafts only from what it wrote itself, as the first requests of their kind on a new server do.
``--history warm``: one Speculator per workload and batch size is kept across the warm-up (run at full length,
over documents of its own) and the repeats (each over other documents), so a run also drafts from what earlier
runs wrote, as a server in steady state does and as vLLM's suffix decoding always does. Runs alternate off/on,
repeat by repeat, so the machine's drift hits both alike. Per workload and batch size: output tokens per second
end to end and in decode steps (the scheduler's time in steps without prefill chunks and the tokens they gave),
the on/off ratio (median of the paired repeats), the mean acceptance length, the mean batch of those decode steps
off and on (requests a step; below ``batch`` where requests have finished and no others wait), what a draft token
cost against a request's share of a decode step (the Speculator's fit of its decode and verify steps' times,
``StepCost``: the ``c`` that ``spec_ceiling --token-costs`` takes), and how many outputs were the same tokens with
speculation on (in fp32 they all are; in bf16 a near-tie may go the other way where a row's arithmetic differs:
on CPUs where a verify row does not get its decode row's bits, or where a prompt is computed in two parts split
at another token, cached prefix and new part or two prefill chunks, as when requests join a full batch at other
steps and find other prompts in the radix cache).
``--compare-unweighted`` adds a third run to each repeat: speculation with n-gram draft lengths from the evidence
classes' estimates alone (``Speculator.weigh_by_support`` off), its decode speed-up and acceptance length beside
the others (with ``--history warm``, from a history of its own runs).
``--requests-per-slot K`` (default 1) keeps the batch full: each run sends ``K * batch`` programs, at most ``batch``
requests run at once (``--max-running-requests``; vLLM's ``max_num_seqs``), and a finished request's slot goes to
the next one, as in a server at that concurrency. With ``K = 1`` a run is one closed batch, whose requests finish
at different steps where drafts are taken at different rates, so its last steps run below ``batch`` (the decode
figures then mix batch sizes).
``--vllm-python`` then runs the workloads through vLLM without speculation, with its n-gram speculation (prompt
lookup) and, where that python has ``arctic_inference``, with its suffix decoding, alternating, on the same CPU,
in a process of its own (vLLM's suffix trees keep every earlier output of the engine, warm-up and earlier
repeats included; with ``--history warm`` its warm-up runs at full length too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from radixrt.bench.spec_workloads import WORKLOADS, run_workload


def new_speculator(engine):
    from radixrt.scheduler.speculation import Speculator

    scheduler = engine.scheduler
    return Speculator(engine.args, scheduler.cache, scheduler.memory, scheduler.context_length)


def _set_speculation(engine, speculator) -> None:
    """Speculation with ``speculator`` (its drafting state as it is), or off (None); only while idle."""
    scheduler = engine.scheduler
    if not scheduler.idle:
        raise RuntimeError("speculation is switched between runs only")
    scheduler.speculator = speculator
    scheduler.output.speculator = speculator


def engine_calls(engine):
    """The workloads' two callables (``spec_workloads``) on a radixrt Engine."""
    def generate(prompts: list[str], params: dict) -> list[tuple[list[int], str]]:
        base = {"max_new_tokens": params["max_new_tokens"], "temperature": params["temperature"]}
        seeds = params.get("seeds") or [None] * len(prompts)
        outs = engine.generate(prompts, [{**base, "seed": s} if s is not None else base for s in seeds])
        outs = outs if isinstance(outs, list) else [outs]
        return [(o["output_ids"], o["text"]) for o in outs]

    def chat(messages: list[dict]) -> str:
        return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return generate, chat


def _set_slots(engine, slots: int) -> None:
    """At most ``slots`` requests decode at once (``--max-running-requests``); only while idle."""
    if not engine.scheduler.idle:
        raise RuntimeError("the running-request limit is set between runs only")
    engine.scheduler.admission.args.max_running_requests = slots


def measure(engine, name: str, batch: int, max_new_tokens: int, on: bool, seed: int, speculator=None,
            unweighted: bool = False, per_slot: int = 1) -> dict:
    """One run; with speculation, through ``speculator`` where given (its history kept), else a fresh one;
    ``unweighted``: its n-gram drafts' lengths from the evidence classes' estimates alone; ``per_slot``: the run's
    ``per_slot * batch`` programs share ``batch`` slots."""
    if on and speculator is None:
        speculator = new_speculator(engine)
    if on:
        speculator.weigh_by_support = not unweighted
    _set_speculation(engine, speculator if on else None)
    _set_slots(engine, batch)
    engine.flush_cache()
    before = engine.get_stats()
    started = time.perf_counter()
    outputs = run_workload(name, *engine_calls(engine), batch * per_slot, max_new_tokens, seed)
    seconds = time.perf_counter() - started
    after = engine.get_stats()
    delta = {k: after[k] - before[k] for k in ("decode_seconds", "decode_tokens", "decode_steps", "decode_requests",
                                                "spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")}
    tokens = sum(len(o) for o in outputs)
    # what a draft token cost this run, against a request's share of a decode step (StepCost, fitted on its steps)
    token_cost = speculator.cost.token_cost(batch) if on else None
    return dict(workload=name, batch=batch, per_slot=per_slot, speculative=on, unweighted=on and unweighted,
                seed=seed, seconds=seconds, tokens=tokens,
                outputs=outputs, tok_s=tokens / seconds, token_cost=token_cost,
                decode_tok_s=delta["decode_tokens"] / delta["decode_seconds"] if delta["decode_seconds"] else 0.0,
                mean_batch=delta["decode_requests"] / delta["decode_steps"] if delta["decode_steps"] else 0.0,
                **{k: delta[k] for k in ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")})


def summarize(rows: list[dict]) -> list[dict]:
    table = []
    keys = sorted({(r["workload"], r["batch"]) for r in rows}, key=lambda k: (WORKLOADS.index(k[0]), k[1]))
    for name, batch in keys:
        mine = [r for r in rows if (r["workload"], r["batch"]) == (name, batch)]
        off = [r for r in mine if not r["speculative"]]
        on = [r for r in mine if r["speculative"] and not r["unweighted"]]
        unweighted = [r for r in mine if r["unweighted"]]
        pairs = list(zip(off, on))
        steps = sum(r["spec_verify_steps"] for r in on)
        accepted = sum(r["spec_accepted_tokens"] for r in on)
        drafted = sum(r["spec_draft_tokens"] for r in on)
        same = sum(a == b for x, y in pairs for a, b in zip(x["outputs"], y["outputs"]))
        table.append(dict(
            workload=name, batch=batch,
            off_tok_s=statistics.median(r["tok_s"] for r in off), on_tok_s=statistics.median(r["tok_s"] for r in on),
            speedup=statistics.median(y["tok_s"] / x["tok_s"] for x, y in pairs),
            off_decode_tok_s=statistics.median(r["decode_tok_s"] for r in off),
            on_decode_tok_s=statistics.median(r["decode_tok_s"] for r in on),
            decode_speedup=statistics.median(y["decode_tok_s"] / x["decode_tok_s"] for x, y in pairs),
            off_mean_batch=statistics.median(r["mean_batch"] for r in off),
            on_mean_batch=statistics.median(r["mean_batch"] for r in on),
            accept_length=(accepted + steps) / steps if steps else 0.0,
            accept_rate=accepted / drafted if drafted else 0.0,
            token_cost=statistics.median(r["token_cost"] for r in on),
            same_outputs=f"{same}/{sum(len(x['outputs']) for x, _ in pairs)}"))
        if unweighted:
            u_steps = sum(r["spec_verify_steps"] for r in unweighted)
            table[-1].update(
                unweighted_decode_speedup=statistics.median(
                    y["decode_tok_s"] / x["decode_tok_s"] for x, y in zip(off, unweighted)),
                unweighted_accept_length=(sum(r["spec_accepted_tokens"] for r in unweighted) + u_steps) / u_steps
                if u_steps else 0.0)
    return table


def run_vllm(python: str, model: str, args: argparse.Namespace) -> list[dict]:
    script = Path(__file__).with_name("spec_workloads.py")
    config = dict(dtype="bfloat16" if args.dtype in ("auto", "bfloat16", "bf16") else "float32",
                  workloads=args.workloads, batch_sizes=args.batch_sizes, max_new_tokens=args.max_new_tokens,
                  repeats=args.repeats, num_draft_tokens=args.num_draft_tokens, warm=args.history == "warm",
                  requests_per_slot=args.requests_per_slot)
    done = subprocess.run([python, str(script), "vllm", model, json.dumps(config)], capture_output=True,
                          text=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT_JSON ")), None)
    if line is None:
        raise RuntimeError(f"vLLM's run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = json.loads(line.removeprefix("RESULT_JSON "))
    table = []
    for name in args.workloads:
        for batch in args.batch_sizes:
            mine = [r for r in rows if (r["workload"], r["batch"]) == (name, batch)]
            speed = {method: [r["tokens"] / r["seconds"] for r in mine if r["method"] == method]
                     for method in dict.fromkeys(r["method"] for r in mine)}
            entry = dict(workload=name, batch=batch, off_tok_s=statistics.median(speed["off"]))
            for method in (m for m in speed if m != "off"):
                entry[f"{method}_tok_s"] = statistics.median(speed[method])
                entry[f"{method}_speedup"] = statistics.median(b / a for a, b in zip(speed["off"], speed[method]))
            table.append(entry)
    return table


def print_table(table: list[dict], vllm: list[dict] | None) -> None:
    head = ("| workload | batch | off tok/s | on tok/s | x | decode off | decode on | decode x | accept length "
            "| accepted | mean batch off / on | draft token cost | same tokens |")
    methods = [m for m in ("ngram", "suffix") if vllm and f"{m}_tok_s" in vllm[0]]
    unweighted = "unweighted_decode_speedup" in table[0]
    if unweighted:
        head += " decode x, class estimate only | its accept length |"
    if vllm:
        head += " vLLM off |" + "".join(f" vLLM {m} | vLLM {m} x |" for m in methods)
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for row in table:
        line = (f"| {row['workload']} | {row['batch']} | {row['off_tok_s']:.1f} | {row['on_tok_s']:.1f} | "
                f"{row['speedup']:.2f} | {row['off_decode_tok_s']:.1f} | {row['on_decode_tok_s']:.1f} | "
                f"{row['decode_speedup']:.2f} | {row['accept_length']:.2f} | {row['accept_rate']:.0%} | "
                f"{row['off_mean_batch']:.1f} / {row['on_mean_batch']:.1f} | "
                f"{row['token_cost']:.2f} | {row['same_outputs']} |")
        if unweighted:
            line += f" {row['unweighted_decode_speedup']:.2f} | {row['unweighted_accept_length']:.2f} |"
        if vllm:
            peer = next(v for v in vllm if (v["workload"], v["batch"]) == (row["workload"], row["batch"]))
            line += f" {peer['off_tok_s']:.1f} |" + "".join(
                f" {peer[f'{m}_tok_s']:.1f} | {peer[f'{m}_speedup']:.2f} |" for m in methods)
        print(line)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-draft-tokens", type=int, default=8)
    p.add_argument("--history", choices=("cold", "warm"), default="cold",
                   help="cold: every run drafts only from itself; warm: drafting state kept across the warm-up "
                        "and the repeats of a workload and batch size (a server in steady state)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None, help="default: the bundled default model")
    p.add_argument("--vllm-python", default=None, help="also run vLLM's n-gram speculation with this python")
    p.add_argument("--json", default=None, help="write the table (and vLLM's) to this file")
    p.add_argument("--compare-unweighted", action="store_true",
                   help="also run speculation with draft lengths from the evidence classes' estimates alone, "
                        "without weighing each token by the earlier occurrences that agree with it")
    p.add_argument("--requests-per-slot", type=_at_least_one, default=1,
                   help="programs a run sends per slot of the batch (at most --batch-sizes requests run at once): "
                        "above 1, a finished request's slot goes to the next one, so the batch stays full")


def run(args: argparse.Namespace) -> int:
    import radixrt
    from radixrt.bench.commands import machine
    from radixrt.model.weights import resolve_model_path
    from radixrt.server_args import DEFAULT_MODEL

    context = {**machine(), "history": args.history, "requests_per_slot": args.requests_per_slot}
    print(" ".join(f"{k}={v}" for k, v in context.items()), flush=True)
    model = str(resolve_model_path(args.model or DEFAULT_MODEL))
    engine = radixrt.Engine(model=model, dtype=args.dtype, speculative_algorithm="NGRAM",
                            speculative_num_draft_tokens=args.num_draft_tokens, log_interval=0,
                            engine_scheduler="thread")  # its speculator's counters are read here
    rows = []
    try:
        for name in args.workloads:
            for batch in args.batch_sizes:
                # (speculation on, unweighted) arms; each keeps a warm history of its own runs only: a second arm
                # drafting from the first's outputs for the same documents would copy them
                arms = [(False, False), (True, False)] + ([(True, True)] if args.compare_unweighted else [])
                warm = {arm: new_speculator(engine) if args.history == "warm" and arm[0] else None for arm in arms}
                warm_up_tokens = args.max_new_tokens if args.history == "warm" else 4
                for arm in arms:  # warm-up: kernels and allocator at these shapes (and the history)
                    measure(engine, name, batch, warm_up_tokens, arm[0], -1, warm[arm], unweighted=arm[1])
                for repeat in range(args.repeats):
                    for arm in arms:
                        rows.append(measure(engine, name, batch, args.max_new_tokens, arm[0], repeat, warm[arm],
                                            unweighted=arm[1], per_slot=args.requests_per_slot))
    finally:
        engine.shutdown()
    table = summarize(rows)
    vllm = None
    if args.vllm_python:  # radixrt's rows are shown and kept first: they stand if vLLM's run fails
        print_table(table, None)
        _write(args.json, context, table, None)
        vllm = run_vllm(args.vllm_python, model, args)
    print_table(table, vllm)
    _write(args.json, context, table, vllm)
    return 0


def _write(path: str | None, context: dict, table: list[dict], vllm: list[dict] | None) -> None:
    if path:
        Path(path).write_text(json.dumps({"machine": context, "radixrt": table, "vllm": vllm}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
