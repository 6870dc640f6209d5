"""HTTP backend: the DSL over a running server's native API (`radixrt serve`, or SGLang's)."""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, Optional

import httpx

from .native import NativeBackend


class RuntimeEndpoint(NativeBackend):
    """`RuntimeEndpoint("http://127.0.0.1:30000")`.

    Calls: GET /get_model_info once (model path, chat template), POST /generate for every
    gen/select/prefix hint, POST /flush_cache; with `use_sessions=True`, POST /open_session and
    /close_session around each program state (see `native`). `transport` (an httpx transport) is for tests.
    """

    def __init__(
        self,
        base_url: str,
        api_key: Optional[str] = None,
        verify: Any = True,
        chat_template_name: Optional[str] = None,
        timeout: Optional[float] = None,
        transport: Optional[httpx.BaseTransport] = None,
        use_sessions: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            headers=headers,
            verify=verify,
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
            transport=transport,
        )
        super().__init__(chat_template=chat_template_name, use_sessions=use_sessions)

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"

    @staticmethod
    def _check(res: httpx.Response) -> None:
        if res.status_code != 200:
            try:
                content = res.json()
            except ValueError:
                content = res.text
            raise RuntimeError(f"HTTP {res.status_code} from {res.request.url}: {content}")

    def _fetch_model_info(self) -> Dict[str, Any]:
        res = self.client.get(self.base_url + "/get_model_info")
        self._check(res)
        return res.json()

    def _request(self, payload: Dict[str, Any]) -> Any:
        res = self.client.post(self.base_url + "/generate", json=payload)
        self._check(res)
        return res.json()

    def _request_stream(self, payload: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        with self.client.stream("POST", self.base_url + "/generate", json=payload) as res:
            if res.status_code != 200:
                res.read()
                self._check(res)
            for line in res.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if isinstance(chunk, dict) and "error" in chunk and "text" not in chunk:
                    raise RuntimeError(f"stream error from {self.base_url}: {chunk['error']}")
                yield chunk

    def _open_session(self) -> str:
        body: Dict[str, Any] = {}
        if self.model_info.get("context_length"):  # SGLang requires a capacity; the context is the natural one
            body["capacity_of_str_len"] = int(self.model_info["context_length"])
        res = self.client.post(self.base_url + "/open_session", json=body)
        self._check(res)
        return res.json()

    def _close_session(self, session_id: str) -> None:
        self._check(self.client.post(self.base_url + "/close_session", json={"session_id": session_id}))

    def flush_cache(self) -> Any:
        res = self.client.post(self.base_url + "/flush_cache")
        self._check(res)
        return True

    def shutdown(self) -> None:
        self.client.close()
