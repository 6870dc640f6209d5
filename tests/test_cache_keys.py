"""Cache isolation keys (SGLang's ``extra_key``, vLLM's ``cache_salt``): a request reads cached prefixes only of
requests with the same key (and the same LoRA adapter), on /generate and both OpenAI routes; its tokens do not
change."""

import uuid

import pytest

from radixrt.memory.radix_cache import cache_namespace
from radixrt.protocol.errors import RequestError
from radixrt.protocol.request import MAX_KEY_CHARS, cache_keys_from
from shared_server import ARGS

SERVER_ARGS = ARGS  # the session's shared server (tests/shared_server.py)
GREEDY = {"max_new_tokens": 4, "temperature": 0}


def test_each_key_and_adapter_has_a_namespace_of_its_own():
    spaces = [cache_namespace(uid, key) for uid in (0, 1, 2) for key in (None, "a", "b", "a\x00", "\x00a")]
    assert len(set(spaces)) == len(spaces)
    assert cache_namespace(0, None) == 0 and cache_namespace(3, None) == 3  # no key: the adapter's own
    assert cache_namespace(1, "a") == cache_namespace(1, "a")


def test_extra_key_and_cache_salt_make_one_key_per_prompt():
    assert cache_keys_from(None, None, 2) is None
    assert cache_keys_from("t", None, 2) == ["t\x00", "t\x00"]
    assert cache_keys_from(None, ["s", None], 2) == ["\x00s", None]
    assert cache_keys_from("t", "s", 1) == ["t\x00s"]
    assert cache_keys_from("", [None, ""], 2) is None  # empty asks for nothing
    for bad in ([1, 2], ["a"], {"a": 1}, "x" * (MAX_KEY_CHARS + 1)):
        with pytest.raises(RequestError, match="extra_key"):
            cache_keys_from(bad, None, 2)


@pytest.mark.model
def test_requests_share_cached_prefixes_only_under_the_same_key(http):
    prompt = f"Tenant notes {uuid.uuid4().hex}: " + "the river runs past the mill and the old stone bridge. " * 6

    def cached(**fields) -> tuple[int, list[int]]:
        res = http.post("/generate", json={"text": prompt, "sampling_params": GREEDY, **fields})
        assert res.status_code == 200, res.text
        return res.json()["meta_info"]["cached_tokens"], res.json()["output_ids"]

    first, tokens = cached(extra_key="tenant-1")
    assert first == 0
    again, same = cached(extra_key="tenant-1")
    assert again > 0 and same == tokens
    for other in ({}, {"extra_key": "tenant-2"}, {"cache_salt": "tenant-1"}):
        hit, same = cached(**other)
        assert hit == 0 and same == tokens, other
    # OpenAI's routes take the same keys: vLLM's cache_salt, SGLang's extra_key
    for route, body in (("/v1/completions", {"prompt": prompt}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})):
        for key in ("cache_salt", "extra_key"):
            hits = []
            for _ in range(2):
                res = http.post(route, json={**body, "max_tokens": 2, "temperature": 0, key: f"{route}-{key}"})
                assert res.status_code == 200, res.text
                hits.append(res.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert hits[0] == 0 and hits[1] > 0, (route, key, hits)


@pytest.mark.model
def test_a_bad_key_is_a_400(http):
    for body in ({"text": "hi", "extra_key": 3}, {"text": ["a", "b"], "cache_salt": ["x"]},
                 {"text": "hi", "extra_key": "k" * (MAX_KEY_CHARS + 1)}):
        res = http.post("/generate", json={**body, "sampling_params": GREEDY})
        assert res.status_code == 400, res.text
    res = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": {"a": 1}})
    assert res.status_code == 400
