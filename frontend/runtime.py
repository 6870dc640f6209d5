"""`sgl.Runtime`: a `radixrt serve` child process and a RuntimeEndpoint to it, as SGLang's Runtime.

    runtime = sgl.Runtime(model_path="smollm2-135m")
    sgl.set_default_backend(runtime)
    ...
    runtime.shutdown()

Keyword arguments are `radixrt serve` options by SGLang's names or radixrt's (``model_path``, ``tp_size``,
``dp_size``, ``mem_fraction_static``, ``max_total_tokens``, ... and ``kv_memory_gb``, ...); each becomes a
command-line flag and the server's parser judges it: an option it does not know (or an abbreviation) is a
``TypeError`` naming it, a value it refuses (an SGLang option asking for something radixrt does not serve:
a KV cache dtype, a quantization other than fp8, ...) a ``ValueError`` with the server's reason. ``log_level`` is
the server's too, and at ``info`` or ``debug`` its output is echoed here.

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


def server_flags(kwargs: Dict[str, Any]) -> List[str]:
    """`radixrt serve` flags for Runtime's keyword arguments: ``name=value`` is ``--name value``, a list
    ``--name v1 v2``, a dict (SGLang's ``lora_paths={name: path}``) ``--name k1=v1 k2=v2``, ``True`` a bare flag,
    ``None`` and ``False`` nothing."""
    flags: List[str] = []
    for name, value in kwargs.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, dict):
            value = [f"{k}={v}" for k, v in value.items()]
        if isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag] if value is True else [flag, str(value)]
    return flags


def _unknown_flags(output: str) -> Optional[str]:
    found = re.search(r"unrecognized arguments: (.*)", output)
    return found.group(1).strip() if found else None


def _refusal(output: str) -> Optional[str]:
    """The server's reason for refusing an option's value (its parser's error line), if that is why it stopped."""
    found = re.search(r"radixrt serve: error: (.*)", output)
    return found.group(1).strip() if found else None


class Runtime:
    """SGLang's `Runtime(model_path=..., ...)`: launch a server, use it as a backend, `shutdown()`."""

    def __init__(self, log_level: str = "error", launch_timeout: float = 600.0, **kwargs: Any) -> None:
        port, host = kwargs.pop("port", None), kwargs.pop("host", "127.0.0.1")
        flags = server_flags({**kwargs, "log_level": log_level})
        self.api_key = kwargs.get("api_key")
        self.server = ServerProcess(flags, port=port, timeout=launch_timeout, echo=log_level in ("debug", "info"),
                                    host=host, die_with_parent=True)
        atexit.register(self.shutdown)
        try:
            self.server.start()
        except (RuntimeError, TimeoutError) as exc:
            self.shutdown()
            unknown = _unknown_flags(self.server.output)
            if unknown is not None:
                names = ", ".join(f.lstrip("-").replace("-", "_") for f in unknown.split() if f.startswith("--"))
                raise TypeError(f"Runtime() got options radixrt does not know: {names}") from exc
            refused = _refusal(self.server.output)
            if refused is not None:
                raise ValueError(f"Runtime(): {refused}") from exc
            raise
        from .backend.runtime_endpoint import RuntimeEndpoint

        self.url = self.server.url
        self.pid = self.server.proc.pid if self.server.proc is not None else None
        self.endpoint = RuntimeEndpoint(self.url, api_key=self.api_key)

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
