"""The DSL's backends against the fake runtime: the native HTTP API (RuntimeEndpoint over an httpx
mock transport), the in-process EngineBackend (the exact engine calls), and the OpenAI backend."""

import json
import subprocess
import sys

import httpx
import pytest

import radixrt as sgl
from radixrt.frontend.backend.engine import EngineBackend
from radixrt.frontend.backend.runtime_endpoint import RuntimeEndpoint
from radixrt.frontend.run import resolve_backend
from fake_engine import FakeEngine, mock_transport


def test_import_radixrt_stays_light():
    code = (
        "import sys, radixrt as sgl; sgl.function; sgl.gen; sgl.RuntimeEndpoint; "
        "bad = [m for m in ('torch', 'transformers', 'openai', 'radixrt.engine') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_public_api_names():
    for name in [
        "function", "gen", "gen_int", "gen_string", "select", "image", "video", "system", "user",
        "assistant", "system_begin", "system_end", "user_begin", "user_end", "assistant_begin",
        "assistant_end", "set_default_backend", "flush_cache", "get_server_info", "global_config",
        "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
        "RuntimeEndpoint", "OpenAI", "EngineBackend", "Runtime",
    ]:
        assert hasattr(sgl, name), name


@pytest.fixture
def engine():
    return FakeEngine(responder=lambda p, sp: " alpha beta gamma delta\nrest")


@pytest.fixture
def endpoint(engine):
    return RuntimeEndpoint("http://fake-server:30000", transport=mock_transport(engine))


def test_runtime_endpoint_generate_select_stream(engine, endpoint):
    assert endpoint.get_model_name() == "fake/fake-model"
    assert endpoint.get_chat_template().role_prefix_and_suffix["user"][0] == "<|im_start|>user\n"

    @sgl.function
    def prog(s, q):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("a", stop="\n", return_logprob=True, top_logprobs_num=2))
        s += "Pick:" + sgl.select("c", ["x", "y"])

    state = prog.run(q="hi", backend=endpoint)
    assert state["a"] == " alpha beta gamma delta"
    assert state["c"] in ("x", "y")
    meta = state.get_meta_info("a")
    assert meta["completion_tokens"] == 4 and len(meta["output_token_logprobs"]) == 4
    assert len(meta["output_top_logprobs"]) == 4
    first = engine.requests[0]
    assert first["return_logprob"] is True

    streamed = prog.run(q="hi", backend=endpoint, stream=True)
    pieces = list(streamed.text_iter("a"))
    assert "".join(pieces) == " alpha beta gamma delta"
    assert streamed["c"] in ("x", "y")
    assert any(r["stream"] for r in engine.requests)

    assert sgl.flush_cache(endpoint) is True
    assert engine.computed_tokens() > 0


def test_runtime_endpoint_http_errors_surface(engine):
    def refuse(request):
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "m"})
        return httpx.Response(400, json={"error": {"message": "prompt too long"}})

    ep = RuntimeEndpoint("http://x", transport=httpx.MockTransport(refuse))
    assert ep.get_chat_template().name == "default"  # no template reported: SGLang's default

    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a")

    state = prog.run(backend=ep)
    assert isinstance(state.error(), RuntimeError) and "prompt too long" in str(state.error())

    def down(request):
        raise httpx.ConnectError("refused")

    with pytest.raises(httpx.ConnectError):
        RuntimeEndpoint("http://x", transport=httpx.MockTransport(down))


def test_runtime_endpoint_sends_native_fields(endpoint, engine):
    sent = []
    inner = mock_transport(engine)

    def spy(request):
        if request.method == "POST":
            sent.append(json.loads(request.content))
        return inner.handle_request(request)

    ep = RuntimeEndpoint("http://x/", transport=httpx.MockTransport(spy), api_key="k")
    assert ep.client.headers["authorization"] == "Bearer k"

    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", max_tokens=3, temperature=0, stop=["."], logprob_start_len=0, return_logprob=True)

    prog.run(backend=ep).sync()
    assert sent[0] == {
        "text": "x",
        "sampling_params": {
            "max_new_tokens": 3, "stop": [".", "<|im_end|>"], "stop_token_ids": [], "temperature": 0, "top_p": 1.0,
            "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "ignore_eos": False,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
    }


class RecordingEngine(FakeEngine):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = []

    def generate(self, **kwargs):
        self.calls.append(kwargs)
        return super().generate(**kwargs)


def test_engine_backend_calls_and_auto_wrapping():
    engine = RecordingEngine(responder=lambda p, sp: " ok")
    sgl.set_default_backend(engine)  # kept as set (SGLang's); wrapped in an EngineBackend when a program runs
    try:
        assert sgl.global_config.default_backend is engine
        wrapper = resolve_backend()
        assert isinstance(wrapper, EngineBackend) and wrapper.engine is engine

        @sgl.function
        def prog(s):
            s += "q" + sgl.gen("a", max_tokens=2)

        state = prog.run()
        assert state["a"] == " ok"
        assert engine.calls[0] == {
            "prompt": "q",
            "sampling_params": {
                "max_new_tokens": 2, "stop": ["<|im_end|>"], "stop_token_ids": [], "temperature": 1.0,
                "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                "presence_penalty": 0.0, "ignore_eos": False,
            },
            "input_ids": None,
            "return_logprob": False,
            "logprob_start_len": None,
            "top_logprobs_num": None,
            "stream": False,
        }
        assert sgl.get_server_info()["model_path"] == "fake/fake-model"
        assert sgl.flush_cache() is True
        # The same engine maps to the same wrapper.
        assert prog.run(backend=engine).stream_executor.backend is wrapper
    finally:
        sgl.set_default_backend(None)


def test_run_batch_over_http_prefills_header_once(engine, endpoint):
    header = "".join(f"Q: question number {k}?\nA: answer {k}.\n" for k in range(40))

    @sgl.function
    def few_shot(s, question):
        s += header + "Q: " + question + "?\nA:" + sgl.gen("answer", stop="\n", max_tokens=8)

    states = few_shot.run_batch([{"question": f"new {i}"} for i in range(12)], backend=endpoint)
    assert all(st["answer"] == " alpha beta gamma delta" for st in states)
    assert engine.requests[0]["text"] == header + "Q: "
    assert engine.requests[0]["sampling_params"] == {"max_new_tokens": 0}
    header_tokens = len(engine.tokenizer.encode(header))
    assert all(r["cached_tokens"] >= header_tokens for r in engine.requests[1:])


def openai_backend(engine, model="fake-model", **kw):
    import openai

    client = openai.OpenAI(
        base_url="http://fake/v1", api_key="EMPTY", http_client=httpx.Client(transport=mock_transport(engine))
    )
    return sgl.OpenAI(model, client=client, **kw)


def test_openai_chat_backend(engine):
    backend = openai_backend(engine)
    assert backend.is_chat_model

    @sgl.function
    def chat(s, q):
        s += sgl.system("Be brief.")
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("answer", max_tokens=4, stop="\n"))

    state = chat.run(q="hello", backend=backend)
    assert state["answer"] == " alpha beta gamma delta"
    assert state.messages()[-1] == {"role": "assistant", "content": "alpha beta gamma delta"}
    # The server rendered the messages with its own template.
    assert engine.requests[0]["text"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert backend.token_usage.completion_tokens == 4

    streamed = chat.run(q="hello", backend=backend, stream=True)
    assert "".join(streamed.text_iter("answer")) == " alpha beta gamma delta"

    @sgl.function
    def not_after_assistant(s):
        s += sgl.user("hi") + "oops" + sgl.gen("x")

    assert "right after an assistant" in str(not_after_assistant.run(backend=backend).error())

    @sgl.function
    def picks(s):
        s += sgl.user("hi")
        s += sgl.assistant(sgl.select("x", ["a", "b"]))

    assert isinstance(picks.run(backend=backend).error(), NotImplementedError)


def test_openai_completion_backend(engine):
    backend = openai_backend(engine, is_chat_model=False)

    @sgl.function
    def prog(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=3, temperature=0)

    state = prog.run(backend=backend)
    assert state["story"] == " alpha beta gamma"
    assert engine.requests[0]["text"] == "Once upon a time"
    assert engine.requests[0]["sampling_params"]["max_new_tokens"] == 3
