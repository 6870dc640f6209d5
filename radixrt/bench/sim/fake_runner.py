"""A stand-in for ModelRunner whose logits are a pure function of each sequence's tokens, read back from the
real page pool, so that any page-table or page-sharing mistake of the scheduler changes its outputs.

What the scheduler uses of a runner, and only that: ``forward(batch)``, ``pool``, ``page_size``,
``config.vocab_size``, ``context_length``, ``device``, ``long_rope_from``, ``adapters`` for LoRA requests
(``FakeAdapters``: three names and their uids), and ``pooling`` for embedding requests (a batch that asks for its
hidden states gets each logits row's scores: a function of its whole prefix read back, as a real one's).

The KV pool is a real ``PagePool`` with a tiny layout (1 layer, 1 head, head_dim 2, fp32). ``forward``:
1. writes every new token's (id, position) into its K slot (``batch.out_slots``), as attention writes K/V; a
   token computed through LoRA adapter u stores ``stored_id(id, u)`` instead, so what an adapter writes differs
   from what the base model or another adapter writes for the same tokens; with ``long_rope_from`` (a LongRoPE
   model's original context) the position is its rotary row (``rope_table_rows``), which differs for a sequence
   rotated long;
2. reads back, through each request's page table, the (id, position) of every position up to the request's
   sequence length, and hashes each prefix (a polynomial hash over (id, stored position) pairs);
3. turns the hash of the prefix ending at each logits row into that row: ``NUM_WORDS`` ordinary word tokens
   (and three punctuation tokens) share the mass with pseudo-random scores, eos gets a small chance, every
   other token sits far below. A wrong, stale or shared-by-mistake page changes the hash and so the tokens.

With ``copying`` (to give speculative drafts something to find), a row whose prefix hash says so copies: the
token that followed the latest earlier occurrence of the row's last token (read back from the KV as well)
scores above every word.

Everything is integer arithmetic until the final scores, so a row does not depend on the batch around it.
``kv_mismatches`` reads back what a request claims to have computed and compares it with its token ids:
the simulation calls it after every step to catch corruption at the step it happens.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import numpy as np
import torch

from radixrt.memory.page_pool import KVLayout, PagePool
from radixrt.model.forward_batch import ForwardBatch
from radixrt.model.pooling import Pooling

MODULUS = 67_108_859  # < 2**26: products of two residues and sums of thousands of them fit in int64
BASE = 1_000_003
WORD_SCALE = 6.0  # word scores spread over [0, 6)
EOS_SCORE_SHIFT = 0.06  # eos wins the argmax for roughly one prefix in a hundred
FLOOR = -20.0  # every token that is neither a word nor eos
COPY_SCORE = WORD_SCALE + 1.0  # a copied token's score, with ``copying``
COPY_SHARE = (5, 8)  # with ``copying``: rows whose prefix hash modulo 8 is below 5 copy (when they can)
ADAPTER_STRIDE = 1 << 17  # above every token id; stored ids stay below 2**24, exact in float32


def stored_id(token: int, adapter_uid: int) -> int:
    """What K holds for ``token`` computed through adapter ``adapter_uid`` (0: the base model)."""
    return token + adapter_uid * ADAPTER_STRIDE


class FakeAdapters:
    """LoRA adapters as the scheduler asks for them (radixrt.scheduler.lora): ``lora1``..``lora3``, uids 1..3."""

    by_name = {f"lora{uid}": SimpleNamespace(name=f"lora{uid}", path="-", uid=uid) for uid in (1, 2, 3)}

    def uid_of(self, name: str) -> int:
        if name not in self.by_name:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        return self.by_name[name].uid


class FakeRunner:
    def __init__(self, vocab_size: int, word_ids: list[int], eos_id: int, page_size: int, num_pages: int,
                 context_length: int = 2048, copying: bool = False, long_rope_from: int | None = None,
                 pooling: Pooling | None = None) -> None:
        self.copying = copying
        self.long_rope_from = long_rope_from
        # a generating model whose embedding requests pool as ``pooling`` says (a real one pools by the last token)
        self.embedding_only, self.pooling, self.matryoshka = False, pooling or Pooling(), None
        self.config = SimpleNamespace(vocab_size=vocab_size, hidden_size=2)
        self.context_length = context_length
        self.device = torch.device("cpu")
        self.adapters = FakeAdapters()
        layout = KVLayout(num_layers=1, kv_heads=1, head_dim=2, page_size=page_size, dtype=torch.float32)
        self.pool = PagePool(layout, num_pages)
        self.vocab_size = vocab_size
        self.scored_ids = torch.tensor(list(word_ids) + [eos_id], dtype=torch.long)
        rng = np.random.default_rng(1234)
        self._mult = rng.integers(1, MODULUS, len(self.scored_ids), dtype=np.int64)
        self._add = rng.integers(0, MODULUS, len(self.scored_ids), dtype=np.int64)
        self._shift = np.zeros(len(self.scored_ids), dtype=np.float32)
        self._shift[-1] = EOS_SCORE_SHIFT
        self._powers = _powers(context_length)
        self._kv_numpy = self._slots_view().numpy()  # the same memory, for cheap checks
        self.forwards = 0
        self.tokens = 0
        self.model_path = "sim"
        self.weight_updates = 0
        self.weights_diverged = False  # no update here copies tensors in place
        self.released: set[str] = set()
        self.memory_releases = 0

    def update_weights(self, model_path) -> None:
        """An update of weights to the same rules (radixrt.scheduler.weights): the outputs stay the solo runs'."""
        self.model_path = str(model_path)
        self.weight_updates += 1

    def release_memory(self, tags: set[str], backup_weights: bool = False) -> None:
        """The pool's memory given back as the real runner gives it (zero when next read); no weights to drop."""
        if "kv_cache" in tags:
            self.pool.release_memory()
        self.released |= tags
        self.memory_releases += 1

    def resume_memory(self, tags: set[str]) -> bool:
        if "kv_cache" in tags:
            self.pool.restore_memory()
        self.released -= tags
        return False

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def _slots_view(self) -> torch.Tensor:
        return self.pool.k_caches[0].view(-1, 2)  # [num_pages * page_size, (id, position)]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        # numpy views of the batch's tensors: these arrays are tiny, and numpy's per-op cost is the lower
        page_size, kv = self.page_size, self._kv_numpy
        out_slots, rope_rows = batch.out_slots.numpy(), batch.positions.numpy()
        positions = self._positions(rope_rows)
        ids = batch.input_ids.numpy()
        if batch.lora_spans:
            ids = ids.copy()
            for uid, start, end in batch.lora_spans:
                ids[start:end] = stored_id(ids[start:end], uid)
        kv[out_slots, 0] = ids
        kv[out_slots, 1] = rope_rows  # a position, or with LongRoPE the rotary row: K differs when rotated long

        seq_lens = batch.seq_lens.numpy().astype(np.int64)
        table = batch.page_table.numpy().astype(np.int64)
        longest = int(seq_lens.max())
        span = np.arange(longest)
        pages = table[:, np.minimum(span // page_size, table.shape[1] - 1)]  # [B, L]
        stored = kv[pages * page_size + span % page_size].astype(np.int64)  # [B, L, 2]
        terms = ((stored[..., 0] + 1) * BASE + stored[..., 1]) % MODULUS * self._powers[:longest] % MODULUS
        terms[span >= seq_lens[:, None]] = 0
        prefix_hashes = terms.cumsum(axis=1) % MODULUS  # [B, L]: hash of positions 0..q

        extend_lens = batch.extend_lens.numpy()
        owner = np.repeat(np.arange(len(seq_lens)), extend_lens)
        rows = batch.logits_indices.numpy()
        hashes = prefix_hashes[owner[rows], positions[rows]]
        self.forwards += 1
        self.tokens += int(extend_lens.sum())
        logits = self.logits_of(hashes)
        if batch.return_hidden:  # an embedding request's "final hidden states": the row's scores
            batch.hidden_states = logits[:, self.scored_ids]
        if self.copying:
            self._copy(logits, stored[owner[rows], :, 0] % ADAPTER_STRIDE, positions[rows], hashes)  # token ids
        return logits

    def _positions(self, rope_rows: np.ndarray) -> np.ndarray:
        """The positions of the rotary rows a batch carries (``rope_table_rows``: long rows start at long_from)."""
        if self.long_rope_from is None:
            return rope_rows
        return rope_rows - self.long_rope_from * (rope_rows >= self.long_rope_from)

    @staticmethod
    def _copy(logits: torch.Tensor, ids: np.ndarray, last: np.ndarray, hashes: np.ndarray) -> None:
        """Rows chosen by their hash copy what followed the latest earlier occurrence of their last token."""
        span = np.arange(ids.shape[1])
        rows = np.arange(len(last))
        same = (ids == ids[rows, last][:, None]) & (span < last[:, None])
        found = same.any(axis=1) & (hashes % COPY_SHARE[1] < COPY_SHARE[0])
        if not found.any():
            return
        latest = ids.shape[1] - 1 - np.argmax(same[:, ::-1], axis=1)
        chosen = rows[found]
        copied = ids[chosen, latest[chosen] + 1].astype(np.int64)
        logits[torch.from_numpy(chosen), torch.from_numpy(copied)] = COPY_SCORE

    def logits_of(self, hashes: np.ndarray) -> torch.Tensor:
        """Rows of logits for prefix hashes (one per row)."""
        mixed = (hashes[:, None] * self._mult + self._add) % MODULUS
        scores = mixed.astype(np.float32) * np.float32(WORD_SCALE / MODULUS) + self._shift
        logits = torch.full((len(hashes), self.vocab_size), FLOOR)
        logits[:, self.scored_ids] = torch.from_numpy(scores)
        return logits

    def kv_mismatches(self, token_ids: list[int], pages: list[int], num_tokens: int, first: int = 0,
                      long_rope: bool = False) -> list[int]:
        """Positions in ``first..num_tokens-1`` whose slots (through ``pages``) do not hold ``token_ids`` there (the
        stored ids: see ``stored_id``) at their rotary rows (``long_rope``: a sequence rotated long)."""
        if num_tokens <= first:
            return []
        positions = np.arange(first, num_tokens)
        table = np.asarray(pages, dtype=np.int64)
        stored = self._kv_numpy[table[positions // self.page_size] * self.page_size + positions % self.page_size]
        want = np.asarray(token_ids[first:num_tokens], dtype=np.float32)
        rows = positions + self.long_rope_from * long_rope if self.long_rope_from is not None else positions
        bad = (stored[:, 0] != want) | (stored[:, 1] != rows)
        return positions[bad].tolist()


@lru_cache(maxsize=8)
def _powers(length: int) -> np.ndarray:
    powers = np.empty(length, dtype=np.int64)
    value = 1
    for i in range(length):
        powers[i] = value
        value = value * 7919 % MODULUS
    return powers
