"""Backend for any OpenAI-compatible server (`radixrt serve`'s /v1, vLLM, OpenAI itself).

Plain generation only: a chat model gets the program's messages (so a gen() must come right
after an assistant role begins); a completion model gets the program's text. select() needs
prompt logprobs, which the OpenAI API does not give: use RuntimeEndpoint or the engine for it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from ..chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path
from ..dtype_regex import REGEX_INT
from ..sampling_params import SglSamplingParams
from .base_backend import BaseBackend

INSTRUCT_MODEL_NAMES = ["gpt-3.5-turbo-instruct"]


@dataclasses.dataclass
class TokenUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = 0


class OpenAI(BaseBackend):
    """`OpenAI("model", base_url="http://127.0.0.1:30000/v1", api_key="EMPTY")`; other keyword
    arguments go to `openai.OpenAI(...)`; `client=` supplies a ready client."""

    def __init__(
        self,
        model_name: str,
        is_chat_model: Optional[bool] = None,
        chat_template: Optional[ChatTemplate] = None,
        is_azure: bool = False,
        *args,
        client: Any = None,
        **kwargs,
    ) -> None:
        super().__init__()
        if client is None:
            try:
                import openai
            except ImportError as e:  # pragma: no cover - openai is a test dependency
                raise ImportError("the OpenAI backend needs the `openai` package: pip install openai") from e
            if "base_url" in kwargs and "api_key" not in kwargs:
                kwargs["api_key"] = "EMPTY"  # a local server needs none; the client insists on one
            client = openai.AzureOpenAI(*args, **kwargs) if is_azure else openai.OpenAI(*args, **kwargs)
        self.client = client
        self.model_name = model_name
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self.chat_template = chat_template or get_chat_template_by_model_path(model_name)
        if is_chat_model is None:
            is_chat_model = model_name not in INSTRUCT_MODEL_NAMES
        self.is_chat_model = is_chat_model
        self.chat_prefix = self.chat_template.role_prefix_and_suffix.get("assistant", ("", ""))[0]
        self.token_usage = TokenUsage()

    def get_model_name(self) -> str:
        return self.model_name

    def _prompt_and_kwargs(self, s, sp: SglSamplingParams):
        kwargs: Dict[str, Any] = sp.to_openai_kwargs()
        wrap = False
        if sp.dtype is None:
            if self.is_chat_model:
                if not s.text_.endswith(self.chat_prefix):
                    raise RuntimeError(
                        "OpenAI chat backend: a gen() must come right after an assistant role "
                        "begins (s += sgl.assistant(sgl.gen(...)))"
                    )
                return {"messages": list(s.messages_)}, kwargs, wrap
            return {"prompt": s.text_}, kwargs, wrap
        if self.is_chat_model:
            raise RuntimeError("OpenAI chat backend: typed gen (dtype/gen_int/gen_string) needs a completion model")
        if sp.dtype in (str, "str", "string"):
            kwargs["stop"] = '"'
            return {"prompt": s.text_ + '"'}, kwargs, True
        if sp.dtype in (int, "int"):
            kwargs["stop"] = [" ", "\n"]
            kwargs.setdefault("extra_body", {})["regex"] = REGEX_INT
            return {"prompt": s.text_}, kwargs, wrap
        raise ValueError(f"OpenAI backend: unsupported dtype {sp.dtype!r}")

    def _count(self, usage) -> Dict[str, Any]:
        if usage is None:
            return {}
        self.token_usage.prompt_tokens += usage.prompt_tokens or 0
        self.token_usage.completion_tokens += usage.completion_tokens or 0
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}

    def generate(self, s, sampling_params: SglSamplingParams):
        prompt, kwargs, wrap = self._prompt_and_kwargs(s, sampling_params)
        if "messages" in prompt:
            ret = self.client.chat.completions.create(model=self.model_name, **prompt, **kwargs)
            text = ret.choices[0].message.content or ""
        else:
            ret = self.client.completions.create(model=self.model_name, **prompt, **kwargs)
            text = ret.choices[0].text
        meta = self._count(getattr(ret, "usage", None))
        meta["finish_reason"] = ret.choices[0].finish_reason
        if wrap:
            text = '"' + text + '"'
        return text, meta

    def generate_stream(self, s, sampling_params: SglSamplingParams):
        prompt, kwargs, wrap = self._prompt_and_kwargs(s, sampling_params)
        if wrap:
            raise RuntimeError("OpenAI backend: streaming a gen_string is not supported")
        return self._stream(prompt, kwargs)

    def _stream(self, prompt, kwargs):
        chat = "messages" in prompt
        api = self.client.chat.completions if chat else self.client.completions
        meta: Dict[str, Any] = {}
        for chunk in api.create(
            model=self.model_name, stream=True, stream_options={"include_usage": True}, **prompt, **kwargs
        ):
            if getattr(chunk, "usage", None) is not None:
                meta.update(self._count(chunk.usage))
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            delta = (choice.delta.content if chat else choice.text) or ""
            if choice.finish_reason is not None:
                meta["finish_reason"] = choice.finish_reason
            if delta:
                yield delta, dict(meta)
        yield "", dict(meta)

    def select(self, s, choices, temperature, choices_method=None):
        raise NotImplementedError(
            "select() needs prompt logprobs, which the OpenAI API does not return: use "
            "RuntimeEndpoint(url) (native API) or the in-process engine for select"
        )
