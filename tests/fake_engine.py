"""A deterministic fake runtime for testing DSL programs without a model.

`FakeEngine` implements the engine interface the DSL uses (`generate`, `get_model_info`,
`flush_cache`) with SGLang's native request/response fields: a word-level tokenizer, a prefix cache
that reports `cached_tokens`, text produced deterministically from the prompt, and logprobs from a
deterministic (or supplied) scoring function. `mock_transport(engine)` serves it over httpx as the
native HTTP API (/generate with SSE streaming, /get_model_info, /flush_cache) and a minimal OpenAI
API (/v1/completions, /v1/chat/completions), so RuntimeEndpoint and the OpenAI backend can be
tested with no server.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from radixrt.frontend.dtype_regex import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

TOKEN_RE = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")

CHATML = {
    "default_system_prompt": None,
    "role_prefix_and_suffix": {
        "system": ["<|im_start|>system\n", "<|im_end|>\n"],
        "user": ["<|im_start|>user\n", "<|im_end|>\n"],
        "assistant": ["<|im_start|>assistant\n", "<|im_end|>\n"],
    },
    "stop_str": ["<|im_end|>"],
}


class FakeTokenizer:
    """Word-level: a word with its leading whitespace, one punctuation mark (with its leading
    whitespace), or trailing whitespace is one token. So "Answer: True" is ["Answer", ":",
    " True"] while "Answer: " ends in [":", " "]: the boundary token heals like a BPE's."""

    bos_token_id = 1
    eos_token_id = 2

    def __init__(self, add_bos: bool = True):
        self.add_bos = add_bos
        self._ids: Dict[str, int] = {"<s>": 1, "</s>": 2}
        self._pieces: Dict[int, str] = {1: "", 2: ""}
        self._lock = threading.Lock()

    def pieces(self, text: str) -> List[str]:
        return TOKEN_RE.findall(text)

    def token_id(self, piece: str) -> int:
        with self._lock:
            tid = self._ids.get(piece)
            if tid is None:
                tid = len(self._ids) + 1
                self._ids[piece] = tid
                self._pieces[tid] = piece
            return tid

    def encode(self, text: str, add_bos: Optional[bool] = None) -> List[int]:
        ids = [self.token_id(p) for p in self.pieces(text)]
        if self.add_bos if add_bos is None else add_bos:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._pieces.get(i, "") for i in ids)


def default_responder(prompt: str, sampling_params: Dict[str, Any]) -> str:
    """Text that depends only on the prompt (and the constraint, if any)."""
    regex = sampling_params.get("regex")
    if regex == REGEX_INT:
        return "42"
    if regex == REGEX_FLOAT:
        return "3.14"
    if regex == REGEX_STR:
        return '"fake"'
    if regex == REGEX_BOOL:
        return "True"
    if sampling_params.get("json_schema") is not None:
        return '{"name": "fake"}'
    h = zlib.crc32(prompt.encode())
    return "".join(f" w{(h + 7 * i) % 1000}" for i in range(64))


def default_logprob(context: str, token: str) -> float:
    """A deterministic pseudo-logprob in (-5, 0)."""
    h = zlib.crc32(f"{context[-16:]}\x00{token}".encode())
    return -0.01 - (h % 1000) / 200.0


class FakeEngine:
    """A deterministic stand-in for radixrt.Engine (see the module docstring).

    responder(prompt_text, sampling_params) -> the text the "model" would write (then cut by
    stop strings and max_new_tokens); logprob_fn(context_text, token_text) -> the logprob of a
    token after a context. Every request is recorded in `requests` (one entry per prompt)."""

    def __init__(
        self,
        responder: Callable[[str, Dict[str, Any]], str] = default_responder,
        logprob_fn: Callable[[str, str], float] = default_logprob,
        chat_template: Optional[Dict[str, Any]] = None,
        model_path: str = "fake/fake-model",
        delay: float = 0.0,
        add_bos: bool = True,
    ):
        self.tokenizer = FakeTokenizer(add_bos=add_bos)
        self.responder = responder
        self.logprob_fn = logprob_fn
        self.chat_template = CHATML if chat_template is None else chat_template
        self.model_path = model_path
        self.delay = delay
        self.requests: List[Dict[str, Any]] = []
        self._cache: Dict[int, Any] = {}  # a trie of token ids: id -> child dict
        self._lock = threading.Lock()

    # Engine interface -------------------------------------------------------------------------
    def get_model_info(self) -> Dict[str, Any]:
        return {
            "model_path": self.model_path,
            "served_model_name": self.model_path.rsplit("/", 1)[-1],
            "context_length": 1 << 20,
            "chat_template": self.chat_template,
            "eos_token_ids": [self.tokenizer.eos_token_id],
        }

    def flush_cache(self) -> bool:
        with self._lock:
            self._cache = {}
        return True

    def generate(
        self,
        prompt=None,
        sampling_params: Optional[Dict[str, Any]] = None,
        input_ids=None,
        return_logprob: bool = False,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None,
        stream: bool = False,
    ):
        sampling_params = dict(sampling_params or {})
        batch = isinstance(prompt, list) or (
            input_ids is not None and len(input_ids) > 0 and isinstance(input_ids[0], list)
        )
        if input_ids is not None:
            items = [list(x) for x in (input_ids if batch else [input_ids])]
            texts = [self.tokenizer.decode(ids) for ids in items]
        elif prompt is not None:
            texts = list(prompt) if batch else [prompt]
            items = [self.tokenizer.encode(t) for t in texts]
        else:
            raise ValueError("generate() needs prompt or input_ids")
        if stream:
            if batch:
                raise ValueError("streaming takes a single prompt")
            return self._stream(texts[0], items[0], sampling_params, return_logprob, logprob_start_len, top_logprobs_num)
        outs = [
            self._one(t, ids, sampling_params, return_logprob, logprob_start_len, top_logprobs_num)
            for t, ids in zip(texts, items)
        ]
        return outs if batch else outs[0]

    # Internals --------------------------------------------------------------------------------
    def _match_and_insert(self, ids: List[int], insert: bool = True) -> int:
        with self._lock:
            node, matched = self._cache, 0
            for tid in ids:
                if tid not in node:
                    break
                node = node[tid]
                matched += 1
            if insert:
                node = self._cache
                for tid in ids:
                    node = node.setdefault(tid, {})
            return matched

    def _completion(self, text: str, ids: List[int], sp: Dict[str, Any]):
        max_new = sp.get("max_new_tokens", 128)
        if max_new == 0:
            return [], "", {"type": "length", "matched": None}
        raw = self.responder(text, sp)
        pieces = self.tokenizer.pieces(raw)
        out = "".join(pieces[:max_new])
        finish: Dict[str, Any] = {"type": "length" if len(pieces) > max_new else "stop", "matched": None}
        stops = sp.get("stop") or []
        if isinstance(stops, str):
            stops = [stops]
        cut = None
        for stop in stops:
            pos = out.find(stop) if stop else -1
            if pos != -1 and (cut is None or pos < cut[0]):
                cut = (pos, stop)
        if cut is not None:
            out = out[: cut[0]]
            finish = {"type": "stop", "matched": cut[1]}
        elif finish["type"] == "stop":
            finish = {"type": "stop", "matched": self.tokenizer.eos_token_id}
        out_ids = [self.tokenizer.token_id(p) for p in self.tokenizer.pieces(out)]
        return out_ids, out, finish

    def _logprob_entries(self, ids: List[int], start: int, top: Optional[int]):
        entries, tops = [], []
        for pos in range(start, len(ids)):
            if pos == 0:
                lp = None
            else:
                lp = self.logprob_fn(self.tokenizer.decode(ids[:pos]), self.tokenizer.decode([ids[pos]]))
            entries.append([lp, ids[pos], None])
            tops.append([[lp, ids[pos], None]] if top else [])
        return entries, tops

    def _meta(self, ids, out_ids, finish, cached, return_logprob, logprob_start_len, top):
        meta: Dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out_ids),
            "cached_tokens": cached,
            "finish_reason": finish,
        }
        if return_logprob:
            start = len(ids) if logprob_start_len is None or logprob_start_len < 0 else logprob_start_len
            meta["input_token_logprobs"], input_tops = self._logprob_entries(ids, min(start, len(ids)), top)
            all_ids = ids + out_ids
            meta["output_token_logprobs"], output_tops = self._logprob_entries(all_ids, len(ids), top)
            if top:
                meta["input_top_logprobs"] = input_tops
                meta["output_top_logprobs"] = output_tops
        return meta

    def _record(self, text, ids, sp, cached, return_logprob, logprob_start_len, stream):
        with self._lock:
            self.requests.append(
                {
                    "text": text,
                    "prompt_tokens": len(ids),
                    "cached_tokens": cached,
                    "sampling_params": sp,
                    "return_logprob": return_logprob,
                    "logprob_start_len": logprob_start_len,
                    "stream": stream,
                    "time": time.monotonic(),
                }
            )

    def _one(self, text, ids, sp, return_logprob, logprob_start_len, top):
        cached = self._match_and_insert(ids)
        self._record(text, ids, sp, cached, return_logprob, logprob_start_len, False)
        if self.delay:
            time.sleep(self.delay)
        out_ids, out, finish = self._completion(text, ids, sp)
        self._match_and_insert(ids + out_ids)
        return {
            "text": out,
            "output_ids": out_ids,
            "meta_info": self._meta(ids, out_ids, finish, cached, return_logprob, logprob_start_len, top),
        }

    def _stream(self, text, ids, sp, return_logprob, logprob_start_len, top) -> Iterator[Dict[str, Any]]:
        cached = self._match_and_insert(ids)
        self._record(text, ids, sp, cached, return_logprob, logprob_start_len, True)
        out_ids, out, finish = self._completion(text, ids, sp)
        pieces = self.tokenizer.pieces(out)
        acc = ""
        for i, piece in enumerate(pieces):
            if self.delay:
                time.sleep(self.delay)
            acc += piece
            yield {
                "text": acc,
                "output_ids": out_ids[: i + 1],
                "meta_info": self._meta(ids, out_ids[: i + 1], None, cached, return_logprob, logprob_start_len, top),
            }
        self._match_and_insert(ids + out_ids)
        yield {
            "text": out,
            "output_ids": out_ids,
            "meta_info": self._meta(ids, out_ids, finish, cached, return_logprob, logprob_start_len, top),
        }

    # Helpers for tests ------------------------------------------------------------------------
    def computed_tokens(self) -> int:
        """Prompt tokens the fake had to compute (not served by its prefix cache), all requests."""
        return sum(r["prompt_tokens"] - r["cached_tokens"] for r in self.requests)


def mock_transport(engine: FakeEngine):
    """An httpx transport serving `engine` as the native HTTP API and a minimal OpenAI API."""
    import httpx

    def sse(chunks: Iterator[Any]) -> Iterator[bytes]:
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    def native_generate(body: Dict[str, Any]) -> httpx.Response:
        kwargs = dict(
            prompt=body.get("text"),
            sampling_params=body.get("sampling_params"),
            input_ids=body.get("input_ids"),
            return_logprob=body.get("return_logprob", False),
            logprob_start_len=body.get("logprob_start_len"),
            top_logprobs_num=body.get("top_logprobs_num"),
        )
        try:
            if body.get("stream"):
                return httpx.Response(
                    200, headers={"content-type": "text/event-stream"}, content=sse(engine.generate(stream=True, **kwargs))
                )
            return httpx.Response(200, json=engine.generate(**kwargs))
        except Exception as e:
            return httpx.Response(400, json={"error": {"message": str(e)}})

    def openai_call(path: str, body: Dict[str, Any]) -> httpx.Response:
        chat = path.endswith("/chat/completions")
        if chat:
            from radixrt.frontend.chat_template import ChatTemplate

            template = ChatTemplate.from_model_info(engine.get_model_info())
            prompt = template.get_prompt(body["messages"]) + template.role_prefix_and_suffix["assistant"][0]
        else:
            prompt = body["prompt"]
        sp = {
            "max_new_tokens": body.get("max_tokens", 16),
            "stop": body.get("stop") or [],
            "temperature": body.get("temperature", 1.0),
        }
        for key in ("regex", "json_schema", "top_k", "min_p"):
            if key in body:
                sp[key] = body[key]
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())

        def choice(text, finish, delta=False):
            if chat:
                key = "delta" if delta else "message"
                return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        if body.get("stream"):
            def chunks():
                prev, last = "", None
                for c in engine.generate(prompt=prompt, sampling_params=sp, stream=True):
                    delta, prev, last = c["text"][len(prev):], c["text"], c
                    if delta:
                        yield {"id": "x", "object": obj + ".chunk", "created": created, "model": body["model"],
                               "choices": [choice(delta, None, True)]}
                m = last["meta_info"]
                yield {"id": "x", "object": obj + ".chunk", "created": created, "model": body["model"],
                       "choices": [choice("", "stop" if m["finish_reason"]["type"] == "stop" else "length", True)]}
                yield {"id": "x", "object": obj + ".chunk", "created": created, "model": body["model"], "choices": [],
                       "usage": {"prompt_tokens": m["prompt_tokens"], "completion_tokens": m["completion_tokens"],
                                 "total_tokens": m["prompt_tokens"] + m["completion_tokens"]}}

            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse(chunks()))
        out = engine.generate(prompt=prompt, sampling_params=sp)
        m = out["meta_info"]
        return httpx.Response(
            200,
            json={
                "id": "x",
                "object": obj,
                "created": created,
                "model": body["model"],
                "choices": [choice(out["text"], "stop" if m["finish_reason"]["type"] == "stop" else "length")],
                "usage": {"prompt_tokens": m["prompt_tokens"], "completion_tokens": m["completion_tokens"],
                          "total_tokens": m["prompt_tokens"] + m["completion_tokens"]},
            },
        )

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path.endswith("/get_model_info"):
            return httpx.Response(200, json=engine.get_model_info())
        if request.method == "POST" and path.endswith("/flush_cache"):
            engine.flush_cache()
            return httpx.Response(200, text="ok")
        if request.method == "POST" and path.endswith("/generate"):
            return native_generate(json.loads(request.content or b"{}"))
        if request.method == "POST" and path.endswith("/completions"):
            return openai_call(path, json.loads(request.content or b"{}"))
        return httpx.Response(404, json={"error": f"no route {request.method} {path}"})

    return httpx.MockTransport(handler)
