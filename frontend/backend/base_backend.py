"""The interface every backend implements (the same method names as SGLang's BaseBackend)."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..chat_template import ChatTemplate, get_chat_template
from ..choices import ChoicesDecision, ChoicesSamplingMethod
from ..sampling_params import SglSamplingParams


class BaseBackend:
    # Chat-only APIs (OpenAI chat models) take messages, not text.
    is_chat_model = False
    # Whether join(mode="concate_and_append") can splice KV caches (no backend here can).
    support_concate_and_append = False

    def __init__(self) -> None:
        self.chat_template: ChatTemplate = get_chat_template("default")

    def get_model_name(self) -> str:
        raise NotImplementedError

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # Prefix caching hints -------------------------------------------------------------------
    def cache_prefix(self, prefix_str: str) -> None:
        """Prefill `prefix_str` so later requests that start with it hit the prefix cache."""

    def commit_lazy_operations(self, s) -> None:
        """Send the program's text so far (s.text_) so forks of it share the cached prefix."""

    def uncache_prefix(self, rid: str) -> None:
        pass

    def begin_program(self, s) -> None:
        pass

    def end_program(self, s) -> None:
        pass

    def end_request(self, rid) -> None:
        pass

    def fork_program(self, src, dst, position_ids_offset=None) -> None:
        pass

    # Model calls ----------------------------------------------------------------------------
    def generate(self, s, sampling_params: SglSamplingParams) -> Tuple[Any, Dict[str, Any]]:
        """Continue s.text_; return (text, meta_info)."""
        raise NotImplementedError

    def generate_stream(
        self, s, sampling_params: SglSamplingParams
    ) -> Iterator[Tuple[str, Dict[str, Any]]]:
        """Continue s.text_; yield (new_text_delta, meta_info) pieces in order."""
        raise NotImplementedError

    def select(
        self,
        s,
        choices: List[str],
        temperature: float,
        choices_method: Optional[ChoicesSamplingMethod] = None,
    ) -> ChoicesDecision:
        raise NotImplementedError

    def concatenate_and_append(self, src_rids: List[str], dst_rid: str) -> None:
        raise NotImplementedError

    # Management -----------------------------------------------------------------------------
    def flush_cache(self) -> Any:
        pass

    def get_server_info(self) -> Any:
        return None

    def shutdown(self) -> None:
        pass
