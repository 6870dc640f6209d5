"""The DSL over the runtime's native generate API (shared by the HTTP and in-process backends).

Subclasses supply three primitives that speak SGLang's native /generate request object
(`{"text" | "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
"top_logprobs_num", "stream"}`):

- `_request(payload) -> dict | list[dict]`
- `_request_stream(payload) -> iterator of dicts` (cumulative "text", SGLang's streaming semantics)
- `_fetch_model_info() -> dict` (the `get_model_info` object)
- `_open_session() -> str`, `_close_session(id)` (only with sessions on)

Sessions (opt-in: `use_sessions=True`, or `backend.with_sessions()` for a view of the same connection): a
program state opens a session on its first model call, sends `session_params={"id": ...}` with each of its
generations (and the prefix call of a select), and closes it once the state has ended and its work is done,
errors included. The server keeps the state's latest context pinned in its prefix cache, so the next call of a
long program (an agent loop) is served from the cache even while other traffic presses on memory. Forks get
sessions of their own. The text sent is the same, so the outputs are too.
"""

from __future__ import annotations

import copy
import json
import threading
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..chat_template import ChatTemplate, get_chat_template
from ..choices import ChoicesDecision, ChoicesSamplingMethod, token_length_normalized
from ..dtype_regex import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from ..global_config import global_config
from ..sampling_params import SglSamplingParams
from .base_backend import BaseBackend

_TOP_LEVEL_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num")


def _apply_dtype(sp: SglSamplingParams) -> SglSamplingParams:
    """gen(dtype=...) / gen_int / gen_string become a regex (and stop strings for numbers)."""
    if sp.dtype is None:
        return sp
    sp = sp.clone()
    stops = sp.stop_list()
    if sp.dtype in (int, "int"):
        regex = REGEX_INT
        stops += [" ", "\n"]
    elif sp.dtype in (float, "float"):
        regex = REGEX_FLOAT
        stops += [" ", "\n"]
    elif sp.dtype in (str, "str", "string"):
        regex = REGEX_STR
    elif sp.dtype in (bool, "bool"):
        regex = REGEX_BOOL
    else:
        raise ValueError(f"gen(dtype=...): unsupported dtype {sp.dtype!r} (int, float, str, bool)")
    if sp.regex is not None:
        warnings.warn(f"gen(): both dtype and regex are set; dtype {sp.dtype!r} wins")
    sp.regex = regex
    sp.stop = stops
    return sp


def _json_schema_str(sp: SglSamplingParams) -> SglSamplingParams:
    if sp.json_schema is not None and not isinstance(sp.json_schema, str):
        sp = sp.clone()
        sp.json_schema = json.dumps(sp.json_schema)
    return sp


class NativeBackend(BaseBackend):
    def __init__(self, chat_template: Optional[ChatTemplate] = None, use_sessions: bool = False) -> None:
        super().__init__()
        self.use_sessions = use_sessions
        self._init_sessions()
        self.model_info: Dict[str, Any] = self._fetch_model_info() or {}
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self.chat_template = chat_template or ChatTemplate.from_model_info(self.model_info)

    # Primitives -----------------------------------------------------------------------------
    def _request(self, payload: Dict[str, Any]) -> Any:
        raise NotImplementedError

    def _request_stream(self, payload: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        raise NotImplementedError

    def _fetch_model_info(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _open_session(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no sessions")

    def _close_session(self, session_id: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no sessions")

    # Sessions -------------------------------------------------------------------------------
    def _init_sessions(self) -> None:
        self._sessions: Dict[str, str] = {}  # program state (executor sid) -> its open session's id
        self._sessions_lock = threading.Lock()
        self._closers: List[threading.Thread] = []

    def with_sessions(self) -> "NativeBackend":
        """The same backend (same connection or engine) with sessions on."""
        view = copy.copy(self)
        view.use_sessions = True
        view._init_sessions()
        return view

    @property
    def open_sessions(self) -> int:
        """Sessions this backend holds open now (states not ended, or ended with work still running)."""
        with self._sessions_lock:
            return len(self._sessions)

    def wait_sessions_closed(self, timeout: Optional[float] = None) -> bool:
        """Wait for the sessions of ended states to be closed; True when none is left open."""
        for t in list(self._closers):
            t.join(timeout)
        return self.open_sessions == 0

    def _session_params(self, s) -> Optional[Dict[str, Any]]:
        if not self.use_sessions:
            return None
        key = getattr(s, "sid", None)
        if key is None:
            return None
        with self._sessions_lock:
            session_id = self._sessions.get(key)
        if session_id is None:  # only the state's worker thread gets here: one open per state
            session_id = self._open_session()
            with self._sessions_lock:
                self._sessions[key] = session_id
        return {"id": session_id}

    def end_program(self, s) -> None:
        """Close the state's session once its worker has run its last node (the program may end first)."""
        if not self.use_sessions:
            return
        worker = getattr(s, "worker", None)

        def close() -> None:
            if worker is not None and worker is not threading.current_thread():
                worker.join()
            with self._sessions_lock:
                session_id = self._sessions.pop(getattr(s, "sid", None), None)
            if session_id is not None:
                try:
                    self._close_session(session_id)
                except Exception:  # the server may be gone; its timeout closes the session
                    pass

        if worker is None or not worker.is_alive() or worker is threading.current_thread():
            close()
            return
        closer = threading.Thread(target=close, name="radixrt-session-close", daemon=True)
        self._closers = [t for t in self._closers if t.is_alive()] + [closer]
        closer.start()

    # BaseBackend ----------------------------------------------------------------------------
    def get_model_name(self) -> str:
        return str(self.model_info.get("model_path") or self.model_info.get("served_model_name") or "")

    def get_server_info(self) -> Dict[str, Any]:
        return dict(self.model_info)

    def _generate_payload(self, s, sampling_params: SglSamplingParams) -> Dict[str, Any]:
        sp = _json_schema_str(_apply_dtype(sampling_params))
        payload: Dict[str, Any] = {"text": s.text_, "sampling_params": sp.to_native_kwargs()}
        for key in _TOP_LEVEL_FIELDS:
            value = getattr(sp, key, None)
            if value is not None:
                payload[key] = value
        session = self._session_params(s)
        if session is not None:
            payload["session_params"] = session
        return payload

    def generate(self, s, sampling_params: SglSamplingParams) -> Tuple[Any, Dict[str, Any]]:
        out = self._request(self._generate_payload(s, sampling_params))
        if isinstance(out, list):  # n > 1
            return [o["text"] for o in out], [o.get("meta_info", {}) for o in out]
        return out["text"], out.get("meta_info", {})

    def generate_stream(self, s, sampling_params: SglSamplingParams):
        # The payload is built now, before the caller starts appending the deltas to s.text_.
        payload = self._generate_payload(s, sampling_params)
        payload["stream"] = True
        return self._deltas(payload)

    def _deltas(self, payload: Dict[str, Any]):
        pos = 0
        for chunk in self._request_stream(payload):
            text = chunk.get("text", "")
            delta = text[pos:]
            pos = len(text)
            yield delta, chunk.get("meta_info", {})

    def cache_prefix(self, prefix_str: str) -> None:
        self._request({"text": prefix_str, "sampling_params": {"max_new_tokens": 0}})

    def commit_lazy_operations(self, s) -> None:
        self._request({"text": s.text_, "sampling_params": {"max_new_tokens": 0}})

    def select(
        self,
        s,
        choices: List[str],
        temperature: float = 0.0,
        choices_method: Optional[ChoicesSamplingMethod] = None,
    ) -> ChoicesDecision:
        """Score every choice by the model's logprobs of its tokens after the prefix.

        1. Prefill the prefix (max_new_tokens=0): caches it and tells its token count P.
        2. One batched call over [prefix] + [prefix + choice ...] with max_new_tokens=0,
           return_logprob and logprob_start_len = P - healing_tokens: the prompt logprobs of
           the boundary and the choice tokens, the prefix served from the cache.
        3. Token healing: a choice's tokens are those that differ from the prefix's own
           tokenization at the boundary onward (so " Paris" merging with a trailing space is
           scored as one token given the text before the space).
        4. unconditional_likelihood_normalized: one more batched call on the choices' token ids
           alone (logprob_start_len=0).
        """
        if not choices:
            raise ValueError("select() needs at least one choice")
        choices_method = choices_method or token_length_normalized
        prefix = s.text_
        first_payload: Dict[str, Any] = {"text": prefix, "sampling_params": {"max_new_tokens": 0}}
        session = self._session_params(s)
        if session is not None:
            first_payload["session_params"] = session
        first = self._request(first_payload)
        prompt_len = int(first["meta_info"]["prompt_tokens"])
        start = max(prompt_len - int(global_config.select_healing_tokens), 0)
        rows = self._request(
            {
                "text": [prefix] + [prefix + c for c in choices],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": start,
            }
        )
        input_token_logprobs, output_token_logprobs, normalized = _choice_logprobs(rows)
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            unconditional = self._unconditional_logprobs(len(choices), input_token_logprobs)

        decision = choices_method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=input_token_logprobs,
            output_token_logprobs=output_token_logprobs,
            unconditional_token_logprobs=unconditional,
        )
        if decision.meta_info is not None:
            decision.meta_info.setdefault("prompt_tokens", prompt_len)
        return decision

    def _unconditional_logprobs(
        self, n_choices: int, input_token_logprobs: List[List[Any]]
    ) -> List[List[Any]]:
        """Each choice's tokens scored alone (no prefix): one batched call over their ids."""
        unconditional: List[List[Any]] = [[] for _ in range(n_choices)]
        todo = [i for i, own in enumerate(input_token_logprobs) if own]
        if todo:
            out = self._request(
                {
                    "input_ids": [[e[1] for e in input_token_logprobs[i]] for i in todo],
                    "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                }
            )
            for i, r in zip(todo, out):
                unconditional[i] = r["meta_info"]["input_token_logprobs"]
        return unconditional


def _choice_logprobs(rows: List[Dict[str, Any]]) -> Tuple[List[List[Any]], List[List[Any]], List[float]]:
    """Per choice, from the rows of [prefix] + [prefix + choice ...]: the logprobs of its own tokens
    (those past the tokens it shares with the prefix's row, so token healing applies), its output
    logprobs, and its mean token logprob (-inf when it has no tokens of its own)."""
    base_ids = [e[1] for e in rows[0]["meta_info"]["input_token_logprobs"]]
    input_token_logprobs: List[List[Any]] = []
    output_token_logprobs: List[List[Any]] = []
    normalized: List[float] = []
    for row in rows[1:]:
        entries = row["meta_info"]["input_token_logprobs"]
        k = 0
        while k < len(base_ids) and k < len(entries) and entries[k][1] == base_ids[k]:
            k += 1
        own = [list(e) for e in entries[k:] if e[0] is not None]
        input_token_logprobs.append(own)
        output_token_logprobs.append(row["meta_info"].get("output_token_logprobs", []))
        values = [e[0] for e in own]
        normalized.append(sum(values) / len(values) if values else float("-inf"))
    return input_token_logprobs, output_token_logprobs, normalized
