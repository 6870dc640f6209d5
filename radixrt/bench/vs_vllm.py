"""`radixrt bench vllm`: radixrt next to vLLM's CPU build on this machine, the same token ids, engines alternating.

    radixrt bench vllm --vllm-python /tmp/radixrt-peers/venv-vllm/bin/python
    radixrt bench vllm --vllm-python PY --workloads a:nocache,b:cache --rounds 3 --json vs-vllm.json
    radixrt bench vllm --vllm-python PY --workloads a:nocache,a:nocache:lora --lora-adapters 4 --lora-rank 16

vLLM is never a dependency: it lives in its own venv and runs `peer_run.py` by file path under that venv's python.
Every engine run is a fresh subprocess (radixrt: `python -m radixrt.bench.peer_run`), so neither engine's
threads, allocator or caches leak into the other's figures. The only speed figure that means something on a VM
that drifts is the ratio of two runs made one after the other, so each table row is radixrt / peer out tok/s
(best of the rounds for each engine). Both engines get the dtype radixrt's `--dtype auto` resolves to here.

The workloads (the ids are those of the team's make_workload.py for the same tokenizer):
  a: 64 distinct prompts x 200 tokens;  b: one shared 1000-token prefix + 64 distinct 30-token suffixes;
  c: 32 conversations x 4 turns sent as 4 waves; turn t re-sends a 300-token system prompt, the conversation so
     far (each earlier 40-token question with a fixed 60-token reply) and a new 40-token question.
  64 output tokens each, greedy, EOS ignored. `--num-prompts N` (a and b: N prompts, c: N // 2 conversations) and
  `--output-len` shrink them for a quick check.
A workload with `:lora` runs through `--lora-adapters` random LoRA adapters of `--lora-rank` on every projection
(radixrt.bench.random_adapters), prompt i through adapter i mod their count, on both engines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact be have do say get make go know take see come "
         "think look want give use find tell ask work seem feel try leave call good new first last long great "
         "little own other old right big high different small large next early young important few public bad "
         "same able river mountain engine cache server memory token kernel thread queue batch prefix tree page "
         "block request stream model layer weight matrix vector compute latency throughput schedule city story "
         "music garden window winter summer ocean forest market doctor teacher student history science").split()
NUM_PROMPTS, OUTPUT_LEN = 64, 64
PREFIX_LEN, QUESTION_LEN = 1000, 30  # b
SYSTEM_LEN, TURN_QUESTION_LEN, TURN_ANSWER_LEN, TURNS = 300, 40, 60, 4  # c
DEFAULT_WORKLOADS = "a:nocache,b:nocache,b:cache,c:cache"
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
PEER_RUN = Path(__file__).with_name("peer_run.py")

Encode = Callable[[str], list[int]]


def ids_exact(encode: Encode, rng: random.Random, n_tokens: int, lead: str) -> list[int]:
    """`n_tokens` ids of a lead sentence followed by seeded random words."""
    text = lead + " " + " ".join(rng.choice(WORDS) for _ in range(n_tokens * 2)) + "."
    return encode(text)[:n_tokens]


def build_workloads(encode: Encode, num_prompts: int = NUM_PROMPTS, output_len: int = OUTPUT_LEN) -> dict:
    """The workloads a, b, c as token ids (the JSON that `peer_run.py` reads)."""
    a = [ids_exact(encode, random.Random(1000 + i), 200, f"Request {i}: summarize the following notes.")
         for i in range(num_prompts)]
    prefix = ids_exact(encode, random.Random(7), PREFIX_LEN, "System context: the following is a long shared document.")
    b = [prefix + ids_exact(encode, random.Random(5000 + i), QUESTION_LEN, f"Question {i}:")
         for i in range(num_prompts)]
    system = ids_exact(encode, random.Random(11), SYSTEM_LEN,
                       "System: you are a helpful assistant for a travel agency.")

    def question(conv: int, k: int) -> list[int]:
        return ids_exact(encode, random.Random(50000 + conv * 100 + k), TURN_QUESTION_LEN, f"User {conv} asks:")

    def answer(conv: int, k: int) -> list[int]:  # stands in for the model's reply
        return ids_exact(encode, random.Random(70000 + conv * 100 + k), TURN_ANSWER_LEN, "Assistant:")

    conversations = max(1, num_prompts // 2)
    waves = [[system + sum((question(conv, k) + answer(conv, k) for k in range(turn)), []) + question(conv, turn)
              for conv in range(conversations)] for turn in range(TURNS)]
    return {"output_tokens": output_len, "a": a, "b": b, "b_prefix_len": len(prefix), "c": waves}


def tokenizer_encoder(model_dir: str) -> Encode:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def parse_workloads(spec: str) -> list[tuple[str, bool, bool]]:
    """`a:nocache,b:cache:lora` -> [("a", False, False), ("b", True, True)]: (workload, cache, through LoRA)."""
    runs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, rest = item.partition(":")
        cache, _, lora = rest.partition(":")
        if name not in ("a", "b", "c") or cache not in ("cache", "nocache") or lora not in ("", "lora"):
            raise ValueError(f"workload {item!r}: expected a|b|c:cache|nocache[:lora]")
        runs.append((name, cache == "cache", lora == "lora"))
    if not runs:
        raise ValueError("no workloads given")
    return runs


def resolve_dtype(dtype: str) -> str:
    """The dtype name radixrt runs `dtype` as on this CPU (`auto` by radixrt's own rule)."""
    from radixrt.model.runner import parse_dtype

    return str(parse_dtype(dtype)).replace("torch.", "")


def machine_line(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    cpu, flags = "unknown", set()
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and cpu == "unknown":
                    cpu = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    isa = ",".join(f for f in SPEED_FLAGS if f in flags) or "none"
    date = datetime.datetime.now().isoformat(timespec="seconds")
    return f"machine: cpu={cpu!r} isa={isa} cores={os.cpu_count()} date={date}"


def vllm_env() -> dict[str, str]:
    """The environment of a vLLM run: its CPU settings (unless set) and none of radixrt's import path."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PYTHONSAFEPATH"] = "1"  # the script's folder (radixrt/bench) must not shadow the peer's modules
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cpus - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    return env


def parse_result(output: str) -> dict | None:
    """The last RESULT_JSON line of a run's output, or None."""
    lines = [line for line in output.splitlines() if line.startswith("RESULT_JSON ")]
    return json.loads(lines[-1].split(" ", 1)[1]) if lines else None


def ratio_rows(results: list[dict]) -> list[dict]:
    """One row per (workload, cache, dtype): each slot's best run (by out tok/s) and radixrt / peer."""
    best: dict[tuple, dict[str, dict]] = {}
    for r in results:
        slots = best.setdefault((r["workload"], r["prefix_caching"], r["dtype"]), {})
        if r["slot"] not in slots or r["out_tok_s"] > slots[r["slot"]]["out_tok_s"]:
            slots[r["slot"]] = r
    rows = []
    for (workload, cache, dtype), slots in best.items():
        ours, peer = slots.get("radixrt", {}), slots.get("peer", {})
        ours_rate, peer_rate = ours.get("out_tok_s", 0.0), peer.get("out_tok_s", 0.0)
        rows.append({"workload": workload, "cache": cache, "dtype": dtype, "radixrt_out_tok_s": ours_rate,
                     "peer_out_tok_s": peer_rate, "ratio": ours_rate / peer_rate if peer_rate else float("nan"),
                     "radixrt_cached": ours.get("cached_prompt_tokens"),
                     "peer_cached": peer.get("cached_prompt_tokens"),
                     "radixrt_init_s": ours.get("init_s"), "peer_init_s": peer.get("init_s")})
    return rows


def format_profile(profile: dict) -> str:
    """``wall 48.8 s; self CPU s: gemm 30.1, attention 4.2, ...`` from peer_run's PROFILE_JSON."""
    classes = sorted(profile["self_cpu_s"].items(), key=lambda kv: -kv[1])
    return f"wall {profile['wall_s']:.1f} s; self CPU s: " + ", ".join(f"{k} {v:.1f}" for k, v in classes)


def format_ratio_table(rows: list[dict], peer_label: str = "vLLM") -> str:
    def cell(value) -> str:
        return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)

    header = (f"{'workload':8} {'cache':6} {'dtype':9} {'radixrt tok/s':>13} {peer_label + ' tok/s':>13} "
              f"{'ratio':>6} {'radixrt cached':>14} {peer_label + ' cached':>14} {'radixrt init s':>14} "
              f"{peer_label + ' init s':>14}")
    lines = [header]
    for r in rows:
        lines.append(f"{r['workload']:8} {str(r['cache']):6} {r['dtype']:9} {r['radixrt_out_tok_s']:13.1f} "
                     f"{r['peer_out_tok_s']:13.1f} {r['ratio']:6.2f} {cell(r['radixrt_cached']):>14} "
                     f"{cell(r['peer_cached']):>14} {cell(r['radixrt_init_s']):>14} {cell(r['peer_init_s']):>14}")
    return "\n".join(lines)


def add_vllm_parser(sub) -> None:
    from radixrt.server_args import DEFAULT_MODEL

    p = sub.add_parser("vllm", help="radixrt next to vLLM's CPU build (its own venv), engines alternating")
    p.add_argument("--vllm-python", default=None, help="the python of a venv with vLLM installed")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", help="auto: what radixrt picks on this CPU, for both engines")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="comma-separated a|b|c:cache|nocache")
    p.add_argument("--rounds", type=int, default=1, help="runs of each engine per workload (best one is kept)")
    p.add_argument("--num-prompts", type=int, default=NUM_PROMPTS, help="a, b: prompts; c: half as many conversations")
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one engine run may take")
    p.add_argument("--json", default=None, help="write the machine, every run and the rows to this file")
    p.add_argument("--profile", action="store_true",
                   help="also profile each run by operator class (torch.profiler; slows both engines)")
    p.add_argument("--lora-adapters", type=int, default=4, help="LoRA adapters of the :lora workloads")
    p.add_argument("--lora-rank", type=int, default=16, help="their rank")
    p.add_argument("--peer-engine", choices=["vllm", "radixrt"], default="vllm",
                   help="self-check: radixrt in the peer slot too (by file path, no vLLM needed)")
    p.set_defaults(run=run_vs_vllm)


def run_engine(cmd: list[str], env: dict[str, str], timeout: float, result_despite_exit: bool = False) -> dict | None:
    """One engine run in a fresh subprocess; its result, or None (with the output's tail on stderr).
    ``result_despite_exit``: a result printed before a non-zero exit counts (an engine that crashed shutting down)."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        output, failed = proc.stdout + proc.stderr, proc.returncode != 0
    except subprocess.TimeoutExpired as exc:  # its partial output may be bytes even with text=True
        parts = [p.decode(errors="replace") if isinstance(p, bytes) else p for p in (exc.stdout, exc.stderr) if p]
        output, failed = "".join(parts) + f"\ntimed out after {timeout:.0f}s", True
    result = None if failed and not result_despite_exit else parse_result(output)
    profile = [line for line in output.splitlines() if line.startswith("PROFILE_JSON")]
    if result is not None and profile:
        result["profile"] = json.loads(profile[-1].split(" ", 1)[1])
    if result is None:
        print("\n".join(output.splitlines()[-30:]), file=sys.stderr)
    return result


def run_vs_vllm(args) -> int:
    from radixrt.model.weights import resolve_model_path

    peer_python = sys.executable if args.peer_engine == "radixrt" else args.vllm_python
    if not peer_python or not os.access(peer_python, os.X_OK):
        print("--vllm-python must name the python of a venv with vLLM (e.g. /tmp/radixrt-peers/venv-vllm/bin/python)",
              file=sys.stderr)
        return 2
    runs = parse_workloads(args.workloads)
    model = str(resolve_model_path(args.model))
    dtype = resolve_dtype(args.dtype)
    peer_label = "vLLM" if args.peer_engine == "vllm" else "peer"
    peer_env = vllm_env() if args.peer_engine == "vllm" else dict(os.environ)
    machine = machine_line()
    print(machine, flush=True)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="radixrt-vs-vllm-") as tmp:
        workload_path = str(Path(tmp) / "workload.json")
        with open(workload_path, "w") as f:
            json.dump(build_workloads(tokenizer_encoder(model), args.num_prompts, args.output_len), f)
        lora_flag: list[str] = []
        if any(lora for _, _, lora in runs):
            from radixrt.bench.random_adapters import write_random_adapters

            paths = write_random_adapters(model, Path(tmp) / "adapters", args.lora_adapters, args.lora_rank)
            lora_flag = ["--lora", ",".join(map(str, paths))]
        slots = [("radixrt", [sys.executable, "-m", "radixrt.bench.peer_run", "radixrt"], dict(os.environ)),
                 ("peer", [peer_python, str(PEER_RUN), args.peer_engine], peer_env)]
        for round_index in range(1, args.rounds + 1):
            for name, cache, lora in runs:
                for slot, cmd, env in slots:
                    label = "radixrt" if slot == "radixrt" else peer_label
                    print(f"[round {round_index}] {label} {name} {'cache' if cache else 'nocache'} {dtype}"
                          f"{' lora' if lora else ''}", file=sys.stderr, flush=True)
                    extra = (["--profile"] if args.profile else []) + (lora_flag if lora else [])
                    result = run_engine([*cmd, model, workload_path, name, "cache" if cache else "nocache", dtype,
                                          *extra], env, args.timeout)
                    if result is None:
                        print(f"{label} failed on workload {name}", file=sys.stderr)
                        return _report(machine, results, peer_label, args.json, 1)
                    results.append({**result, "slot": slot, "round": round_index})
                    print("RESULT_JSON", json.dumps(results[-1]), flush=True)
                    if "profile" in result:
                        print(f"profile {label} {name}: {format_profile(result['profile'])}", flush=True)
    return _report(machine, results, peer_label, args.json, 0)


def _report(machine: str, results: list[dict], peer_label: str, json_path: str | None, code: int) -> int:
    rows = ratio_rows(results)
    if rows:
        print(machine)
        print(format_ratio_table(rows, peer_label))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": machine, "results": results, "rows": rows}, f, indent=2)
        print(f"wrote {json_path}")
    return code
