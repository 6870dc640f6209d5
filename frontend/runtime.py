"""`sgl.Runtime`: a `radixrt serve` child process and a RuntimeEndpoint to it, as SGLang's Runtime.

    runtime = sgl.Runtime(model_path="smollm2-135m")
    sgl.set_default_backend(runtime)
    ...
    runtime.shutdown()

Keyword arguments take SGLang's names where radixrt has the option (``model_path`` is ``--model``,
``max_total_tokens`` becomes ``--max-total-pages``; ``tp_size``, ``port``, ``dtype``, ... keep their names) and
radixrt's own ``radixrt serve`` options; each becomes a command-line flag. SGLang options that only tune its
own machinery (``mem_fraction_static``, ``log_level``, CUDA graphs, ...) are accepted and have no effect; an
SGLang option that would change results and that radixrt lacks (LoRA, quantization, ``dp_size`` > 1, ...) is a
``ValueError``; an option neither knows is a ``TypeError`` naming it (judged by the server's parser, then by
the option names its /server_info lists, since the parser also takes abbreviations).

The server dies with this process (``die_with_parent``), on ``shutdown()`` and at interpreter exit. The
Runtime is a backend (``set_default_backend(runtime)``: programs run on ``runtime.endpoint``) and has SGLang's
``generate`` (the response as a JSON string), ``async_generate`` (text chunks), ``add_request`` and
``get_tokenizer`` (transformers, loaded on use).
"""

from __future__ import annotations

import atexit
import json
import re
from typing import Any, AsyncIterator, Dict, List, Optional

from .launcher import ServerProcess

RENAMED = {"model_path": "model"}
# SGLang options that tune only its own machinery: accepted, no effect on radixrt.
NO_EFFECT = frozenset({
    "mem_fraction_static", "log_level", "log_level_http", "trust_remote_code", "enable_torch_compile", "watchdog_timeout", "enable_metrics", "show_time_cost",
    "base_gpu_id", "stream_interval", "skip_server_warmup", "decode_log_interval", "file_storage_path",
    "enable_priority_scheduling",  # radixrt's scheduler always honours priorities
})
# SGLang options radixrt lacks that would change results: option -> the values that ask for nothing.
UNSUPPORTED: Dict[str, tuple] = {
    "lora_paths": (None, [], {}), "enable_lora": (None, False), "quantization": (None,),
    "chat_template": (None,), "is_embedding": (None, False),
    "skip_tokenizer_init": (None, False), "kv_cache_dtype": (None, "auto"), "dp_size": (None, 1),
    "json_model_override_args": (None, "{}"), "tokenizer_mode": (None, "auto"), "load_format": (None, "auto"),
}


def server_flags(kwargs: Dict[str, Any]) -> List[str]:
    """`radixrt serve` flags for Runtime's keyword arguments (ValueError for what radixrt cannot do)."""
    flags: List[str] = []
    kwargs = dict(kwargs)
    tokenizer = kwargs.pop("tokenizer_path", None)
    if tokenizer is not None and tokenizer != kwargs.get("model_path", kwargs.get("model")):
        raise ValueError("Runtime(tokenizer_path=...) must name the model's own folder: radixrt loads the "
                         "tokenizer from the model")
    total_tokens = kwargs.pop("max_total_tokens", None)
    if total_tokens is not None:
        page = int(kwargs.get("page_size", 16))
        kwargs.setdefault("max_total_pages", -(-int(total_tokens) // page))
    for name, value in kwargs.items():
        if name in NO_EFFECT:
            continue
        if name in UNSUPPORTED:
            if not any(type(value) is type(off) and value == off or value is off for off in UNSUPPORTED[name]):
                raise ValueError(f"Runtime({name}={value!r}) is not supported by radixrt")
            continue
        if value is None or value is False:
            continue
        flag = "--" + RENAMED.get(name, name).replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def _unknown_flags(output: str) -> Optional[str]:
    found = re.search(r"unrecognized arguments: (.*)", output)
    return found.group(1).strip() if found else None


class Runtime:
    """SGLang's `Runtime(model_path=..., ...)`: launch a server, use it as a backend, `shutdown()`."""

    def __init__(self, log_level: str = "error", launch_timeout: float = 600.0, **kwargs: Any) -> None:
        port, host = kwargs.pop("port", None), kwargs.pop("host", "127.0.0.1")
        flags = server_flags(kwargs)
        self.api_key = kwargs.get("api_key")
        self.server = ServerProcess(flags, port=port, timeout=launch_timeout, echo=log_level in ("debug", "info"),
                                    host=host, die_with_parent=True)
        atexit.register(self.shutdown)
        try:
            self.server.start()
        except (RuntimeError, TimeoutError) as exc:
            self.shutdown()
            unknown = _unknown_flags(self.server.output)
            if unknown is None:
                raise
            names = ", ".join(f.lstrip("-").replace("-", "_") for f in unknown.split() if f.startswith("--"))
            raise TypeError(f"Runtime() got options radixrt does not know: {names}") from exc
        from .backend.runtime_endpoint import RuntimeEndpoint

        self.url = self.server.url
        self.pid = self.server.proc.pid if self.server.proc is not None else None
        self.endpoint = RuntimeEndpoint(self.url, api_key=self.api_key)
        # The server's parser takes an abbreviation of a flag; only exact names are options here.
        known = set(self.get_server_info()["server_args"])
        inexact = [f[2:].replace("-", "_") for f in flags if f.startswith("--")
                   and f[2:].replace("-", "_") not in known]
        if inexact:
            self.shutdown()
            raise TypeError(f"Runtime() got options radixrt does not know: {', '.join(inexact)}")

    def __repr__(self) -> str:
        return f"Runtime({self.url!r})"

    # ----- SGLang's Runtime methods --------------------------------------------------------------------

    def _payload(self, prompt: Any, sampling_params: Optional[Dict[str, Any]], **extra: Any) -> Dict[str, Any]:
        body: Dict[str, Any] = {"text": prompt, "sampling_params": sampling_params or {}}
        body.update({k: v for k, v in extra.items() if v is not None})
        return body

    def generate(self, prompt: Any, sampling_params: Optional[Dict[str, Any]] = None, return_logprob: bool = False,
                 logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
                 lora_path: Optional[str] = None) -> str:
        """POST /generate; the response as a JSON string, as SGLang's Runtime returns it."""
        payload = self._payload(prompt, sampling_params, return_logprob=return_logprob,
                                logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                                lora_path=lora_path)
        res = self.endpoint.client.post(self.url + "/generate", json=payload)
        self.endpoint._check(res)
        return json.dumps(res.json())

    async def async_generate(self, prompt: str, sampling_params: Optional[Dict[str, Any]] = None
                             ) -> AsyncIterator[str]:
        """Stream one prompt's text, chunk by chunk (the new text at each step)."""
        import httpx

        payload = {**self._payload(prompt, sampling_params), "stream": True}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        sent = 0
        async with httpx.AsyncClient(timeout=None, headers=headers) as client:
            async with client.stream("POST", self.url + "/generate", json=payload) as res:
                if res.status_code != 200:
                    await res.aread()
                    raise RuntimeError(f"HTTP {res.status_code} from {self.url}/generate: {res.text}")
                async for line in res.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk and "text" not in chunk:
                        raise RuntimeError(f"stream error from {self.url}: {chunk['error']}")
                    text = chunk["text"]
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)

    add_request = generate

    def get_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        info = self.endpoint._fetch_model_info()
        return AutoTokenizer.from_pretrained(info.get("tokenizer_path") or info["model_path"])

    def get_server_info(self) -> Dict[str, Any]:
        res = self.endpoint.client.get(self.url + "/server_info")
        self.endpoint._check(res)
        return res.json()

    # ----- as a backend (SGLang's Runtime hands these to its endpoint) -----------------------------------

    def __getattr__(self, name: str) -> Any:
        if name in ("endpoint", "server"):  # not set yet: __init__ failed part-way
            raise AttributeError(name)
        return getattr(self.endpoint, name)

    def shutdown(self) -> None:
        """Stop the server (and so its helpers); safe to call twice."""
        endpoint = self.__dict__.get("endpoint")
        if endpoint is not None:
            endpoint.shutdown()
        server = self.__dict__.get("server")
        if server is not None and server.proc is not None and server.proc.poll() is None:
            server.stop()
        atexit.unregister(self.shutdown)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter teardown
            pass
