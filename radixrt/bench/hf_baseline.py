"""The transformers baseline: the same prompts through ``model.generate`` in static batches, left padded.

Same weights, same dtype, greedy, the same output length per request (min_new_tokens = max_new_tokens, so
EOS cannot end a row early). The attention mask is passed explicitly: SmolLM's pad id (<|im_end|>) also
occurs inside chat prompts, so a mask inferred from the pad id would be wrong. Requests of one batch share
one ``max_new_tokens`` (the batch's largest); only each request's own length counts as output. Within a
turn the requests are sorted by output length first, which helps the baseline (less padding waste).
Multi-turn conversations run turn by turn: all conversations' turn t form the batches of round t, with the
baseline's own earlier outputs as history.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from radixrt.bench.report import RequestRecord, Summary, summarize
from radixrt.bench.workloads import Workload, prompt_of


class HFBaseline:
    def __init__(self, model_path: str | Path, dtype: torch.dtype, pad_token_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        self.pad = pad_token_id
        self.dtype = dtype

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """One left-padded batch; returns each row's ``new_tokens`` generated ids."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=self.pad, temperature=None, top_p=None, top_k=None,
        )
        return [row[width:].tolist() for row in out]

    def run_workload(self, workload: Workload, batch_size: int = 16, label: str = "transformers",
                     progress: bool = True) -> Summary:
        from tqdm import tqdm

        records: list[RequestRecord] = []
        outputs: list[list[list[int]]] = [[] for _ in workload.conversations]
        rounds = max(len(c) for c in workload.conversations)
        bar = tqdm(total=workload.num_requests, desc=label, disable=not progress, leave=False)
        started = time.perf_counter()
        for t in range(rounds):
            todo = [i for i, c in enumerate(workload.conversations) if len(c) > t]
            todo.sort(key=lambda i: -workload.conversations[i][t].output_len)
            for b in range(0, len(todo), batch_size):
                chunk = todo[b: b + batch_size]
                prompts = [prompt_of(workload.conversations[i], t, outputs[i]) for i in chunk]
                lens = [workload.conversations[i][t].output_len for i in chunk]
                sent = time.perf_counter()
                generated = self.generate(prompts, max(lens))
                done = time.perf_counter() - sent
                for i, p, n, g in zip(chunk, prompts, lens, generated):
                    outputs[i].append(g[:n])
                    records.append(RequestRecord(prompt_tokens=len(p), output_tokens=n, latency=done))
                bar.update(len(chunk))
        seconds = time.perf_counter() - started
        bar.close()
        return summarize(f"{label} (batch {batch_size})", records, seconds, {"dtype": str(self.dtype)[6:]})

    def decode_rate(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Decode tokens/s of one batch: (generate n tokens - generate 1 token) removes the prefill."""
        self.generate(prompts, 2)  # warm-up
        t0 = time.perf_counter()
        self.generate(prompts, 1)
        t1 = time.perf_counter()
        self.generate(prompts, new_tokens)
        t2 = time.perf_counter()
        return len(prompts) * (new_tokens - 1) / max((t2 - t1) - (t1 - t0), 1e-9)
