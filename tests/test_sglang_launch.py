"""A launch script written for SGLang starts radixrt unchanged: `python -m radixrt.launch_server` with SGLang's
flags (`--model-path`, `--port`, `--tp-size`, `--mem-fraction-static`, `--max-total-tokens`, `--chat-template`,
`--log-level`, `--trust-remote-code`, `--enable-metrics`, ...) serves, and each served flag shows its effect."""

from __future__ import annotations

import openai
import pytest

from radixrt.server.server_process import ServerProcess

pytestmark = pytest.mark.model

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}<</{{ m['role'] }}>>\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")


@pytest.fixture(scope="module")
def launched(tmp_path_factory, default_model_path):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    flags = ["--model-path", "smollm2-135m", "--tp-size", "1", "--mem-fraction-static", "0.2",
             "--max-total-tokens", "2048", "--chat-template", str(template), "--log-level", "warning",
             "--trust-remote-code", "--enable-metrics", "--dtype", "float32", "--served-model-name", "sglang-like"]
    server = ServerProcess(flags, module="radixrt.launch_server").start()
    yield server
    server.stop()


def test_the_flags_of_an_sglang_launch_script_take_effect(launched):
    import httpx

    info = httpx.get(launched.url + "/get_server_info", timeout=60).json()
    args = info["server_args"]
    assert (args["model"], args["tp_size"], args["mem_fraction_static"]) == ("smollm2-135m", 1, 0.2)
    assert (args["log_level"], args["trust_remote_code"], args["enable_metrics"]) == ("warning", True, True)
    assert info["stats"]["pages_total"] == 2048 // 16  # --max-total-tokens fixes the pool
    roles = info["model_info"]["chat_template"]["role_prefix_and_suffix"]
    assert roles["user"] == ["<<user>>", "<</user>>\n"]  # --chat-template replaced the tokenizer's


def test_an_openai_client_chats_through_the_given_template(launched):
    client = openai.OpenAI(base_url=launched.url + "/v1", api_key="none", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model="sglang-like", max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": "Hi"}])
    assert answer.choices[0].message.content
    from radixrt.tokenizer import load_tokenizer
    from radixrt.model.weights import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m"))
    prompt = "<<user>>Hi<</user>>\n<<assistant>>"
    assert answer.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_log_level_warning_keeps_info_lines_out(launched):
    import httpx

    res = httpx.post(launched.url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
                     timeout=120)
    assert res.status_code == 200
    # at info the server logs a line per finished request ("request <rid>: stop after ..."); not at warning
    assert f"request {res.json()['meta_info']['id']}" not in launched.output
