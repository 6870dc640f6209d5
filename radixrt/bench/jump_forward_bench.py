"""Jump-forward decoding on vs off on a JSON-schema workload (the default model, Engine, greedy).

    python -m radixrt.bench.jump_forward_bench [--requests 8] [--repeats 2] [--dtype float32]

One engine; jump-forward is switched per run (``engine.grammars.jump_forward_enabled``), runs alternate
off/on so load drift hits both. Grammars are compiled (and the model warmed) before timing. Per mode:
forward steps (Engine stats ``steps``), wall seconds, output tokens, jump-forward tokens, and whether
every output validates against its schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMAS = [
    {"type": "object", "properties": {
        "first_name": {"type": "string", "maxLength": 12}, "last_name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}, "is_employed": {"type": "boolean"},
        "department": {"enum": ["engineering", "marketing", "operations"]}},
     "required": ["first_name", "last_name", "age", "is_employed", "department"]},
    {"type": "object", "properties": {
        "product_name": {"type": "string", "maxLength": 16}, "unit_price": {"type": "number", "minimum": 0, "maximum": 1000},
        "in_stock": {"type": "boolean"}, "category": {"enum": ["hardware", "software", "services"]},
        "warehouse": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                       "shelf_number": {"type": "integer", "minimum": 1, "maximum": 99}},
                      "required": ["city", "shelf_number"]}},
     "required": ["product_name", "unit_price", "in_stock", "category", "warehouse"]},
]


def _workload(n: int):
    prompts, params = [], []
    for i in range(n):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(f"Example {i}. Write one JSON object matching this schema: {json.dumps(schema)}\nJSON:")
        params.append({"json_schema": json.dumps(schema), "temperature": 0.0, "max_new_tokens": 128})
    return prompts, params


def main(argv: list[str] | None = None) -> dict:
    import jsonschema

    import radixrt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    prompts, params = _workload(args.requests)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with radixrt.Engine(dtype=args.dtype, kv_memory_gb=0.2, log_interval=0, engine_scheduler="thread") as engine:
        engine.generate(prompts[:2], [{**p, "max_new_tokens": 2} for p in params[:2]])  # compile + warm up
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                engine.grammars.jump_forward_enabled = mode == "on"
                engine.flush_cache()
                before = engine.get_stats()
                start = time.perf_counter()
                outs = engine.generate(prompts, params)
                wall = time.perf_counter() - start
                after = engine.get_stats()
                valid = True
                for out, p in zip(outs, params):
                    try:
                        jsonschema.validate(json.loads(out["text"]), json.loads(p["json_schema"]))
                    except (ValueError, jsonschema.ValidationError):
                        valid = False
                runs[mode].append({
                    "steps": after["steps"] - before["steps"],
                    "wall_s": round(wall, 2),
                    "output_tokens": sum(len(o["output_ids"]) for o in outs),
                    "output_chars": sum(len(o["text"]) for o in outs),
                    "jump_forward_tokens": after["jump_forward_tokens"] - before["jump_forward_tokens"],
                    "all_valid": valid,
                })
        engine.grammars.jump_forward_enabled = True
    result = {"requests": args.requests, "dtype": args.dtype, "runs": runs}
    for mode, rs in runs.items():
        result[f"{mode}_median_wall_s"] = round(statistics.median(r["wall_s"] for r in rs), 2)
        result[f"{mode}_steps"] = [r["steps"] for r in rs]
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
