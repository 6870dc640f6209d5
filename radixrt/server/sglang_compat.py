"""The fields of SGLang's request bodies that radixrt accepts without serving them, by API.

``GENERATE`` is SGLang's ``GenerateReqInput`` (POST /generate) beyond what radixrt implements; ``OPENAI`` is its
OpenAI-request extensions (ChatCompletionRequest / CompletionRequest) beyond what radixrt implements; the
sampling params' own list is ``radixrt.sampling.params.SGLANG_FIELDS``. Each field is ``Ignored`` (does not
change the result: accepted, logged once) or ``Unsupported`` (asks for something radixrt cannot do: refused
with a 400 naming it unless it holds a value that asks for nothing). The rules are in
radixrt.sampling.compat_fields; the request structs (native_protocol, openai_protocol) declare these fields
from these tables, so unknown names are still refused.
"""

from __future__ import annotations

from typing import Any

from radixrt.sampling.compat_fields import Ignored, Rule, Unsupported, check_fields
from radixrt.protocol.errors import RequestError

ONE_MODEL = Ignored("a radixrt server serves one model")
ONE_RANK = Ignored("a radixrt server is one data-parallel rank; the router picks the worker")
LOGGING = Ignored("a logging or metrics switch; it does not change the output")
SESSION_ID = Ignored("a session's identity; it does not change the prompt")
PD = Unsupported("prefill-decode disaggregation")
MULTIMODAL = Unsupported("multimodal input; radixrt serves text models")
LORA_ID = Unsupported("LoRA adapter ids (name the adapter with lora_path)")
CUSTOM_LOGITS = Unsupported("custom logit processors")
HIDDEN = Unsupported("returning hidden states", (None, False))
EXPERTS = Unsupported("returning routed experts (radixrt serves dense models)")
REASONING = Unsupported("reasoning budgets and effort (--reasoning-parser only separates the reasoning)")

_SHARED: dict[str, Rule] = {
    "data_parallel_rank": ONE_RANK,
    "routed_dp_rank": ONE_RANK,
    "session_id": SESSION_ID,
    "custom_labels": LOGGING,
    "custom_logit_processor": CUSTOM_LOGITS,
    "return_hidden_states": HIDDEN,
    "return_routed_experts": EXPERTS,
    "routed_experts_start_len": Unsupported("returning routed experts", (None, 0)),
    "bootstrap_host": PD,
    "bootstrap_port": PD,
    "bootstrap_room": PD,
    "disagg_prefill_dp_rank": PD,
    "images_config": MULTIMODAL,
    "max_dynamic_patch": MULTIMODAL,
    "min_dynamic_patch": MULTIMODAL,
    "use_audio_in_video": MULTIMODAL,
    "return_prompt_token_ids": Unsupported("returning the prompt's token ids"),
}

GENERATE: dict[str, Rule] = {
    **_SHARED,
    "model": ONE_MODEL,
    "log_metrics": LOGGING,
    "no_logs": LOGGING,
    "conversation_id": LOGGING,
    "external_trace_header": LOGGING,
    "received_time": LOGGING,
    "routing_key": Ignored("a hint for SGLang's routing-key scheduling policy"),
    "kv_router_hint": Ignored("a hint for SGLang's hierarchical cache storage"),
    "http_worker_ipc": Ignored("SGLang's internal reply address"),
    "modalities": Ignored("describes multimodal data, which radixrt refuses on its own"),
    "input_embeds": Unsupported("input embeddings instead of token ids"),
    "image_data": MULTIMODAL,
    "video_data": MULTIMODAL,
    "audio_data": MULTIMODAL,
    "mm_hashes": MULTIMODAL,
    "mm_content_hashes": MULTIMODAL,
    "video_config": MULTIMODAL,
    "image_max_dynamic_patch": MULTIMODAL,
    "video_max_dynamic_patch": MULTIMODAL,
    "need_wait_for_mm_inputs": MULTIMODAL,
    "num_items_assigned": MULTIMODAL,
    "encoder_urls": MULTIMODAL,
    "return_sampling_mask": Unsupported("returning the sampling mask"),
    "return_flat_raw_top_logprobs": Unsupported("flat top-logprob arrays"),
    "return_flat_raw_top_logprobs_b64": Unsupported("flat top-logprob arrays"),
    "return_indexer_topk": EXPERTS,
    "lora_id": LORA_ID,
    "positional_embed_overrides": Unsupported("embedding overrides"),
    "bootstrap_pair_key": PD,
    "decode_tp_size": PD,
    "background": Unsupported("background requests"),
    "require_reasoning": REASONING,
    "max_thinking_tokens": REASONING,
    "return_bytes": Unsupported("returning bytes"),
    "return_entropy": Unsupported("returning entropy"),
    "multi_item_delimiter_indices": Unsupported("multi-item scoring"),
}

OPENAI: dict[str, Rule] = {
    **_SHARED,
    "ngram_corpus_id": Ignored("a corpus for SGLang's n-gram speculative decoding, which never changes outputs"),
    "no_stop_trim": Unsupported("keeping the matched stop string in the output", (None, False)),
    "continue_final_message": Unsupported("continuing the final assistant message", (None, False)),
    "custom_params": CUSTOM_LOGITS,
    "return_cached_tokens_details": Unsupported("cached-token details"),
    "return_token_ids": Unsupported("returning token ids"),
    "return_meta_info": Unsupported("returning SGLang's meta info"),
    "reasoning_effort": REASONING,
    "reasoning": REASONING,
    "task": Unsupported("DeepSeek task tokens"),
    "input_ids": Unsupported("pre-tokenized chat prompts"),
}


def check(body: Any, rules: dict[str, Rule]) -> None:
    """Refuse a field asking for what radixrt cannot do (RequestError, a 400, naming it); log ignored ones once."""
    try:
        check_fields(body, rules)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
