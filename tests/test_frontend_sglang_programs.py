"""Programs written the way SGLang's own frontend tests write them run unchanged with
`import radixrt as sgl` (here on a scripted fake model; the end-to-end versions on the default
model come with the engine and server)."""

import json
import re

import pytest

import radixrt as sgl
from fake_engine import FakeEngine, default_responder

CAPITALS = {"United States": "Washington", "Japan": "Tokyo", "United Kingdom": "London", "China": "Beijing",
            "France": "Paris"}


def scripted(prompt, sp):
    """A tiny 'model': answers the last question it sees; otherwise a constrained or filler reply."""
    if sp.get("regex") or sp.get("json_schema"):
        return default_responder(prompt, sp)
    tail = prompt[-200:]
    if tail.rstrip().endswith("calculate("):
        return "257*983) = ..."
    last_q = tail[tail.rfind("Q:"):]
    for country, city in CAPITALS.items():
        if "capital" in last_q and last_q.endswith(f"{country}?\nA:"):
            return f" {city}\nQ: more"
    if tail.endswith("A good person to answer this question is"):
        return " a French geographer. Next"
    if re.search(r"(Thought|Observation) \d:$", tail):
        return " I should look it up.\n"
    if tail.endswith(" ["):
        return "Finland]. done"
    return " fine words here.\n\nmore"


def logprobs(context, token):
    # "Finish" and "True" are what this 'model' prefers.
    return {"Finish": -0.1, " Finish": -0.1, "True": -0.2, " True": -0.2}.get(token.strip() and token, -2.0)


@pytest.fixture(autouse=True)
def backend():
    engine = FakeEngine(responder=scripted, logprob_fn=logprobs)
    sgl.set_default_backend(engine)
    yield engine
    sgl.set_default_backend(None)


def test_few_shot_qa():
    @sgl.function
    def few_shot_qa(s, question):
        s += "The following are questions with answers.\n\n"
        s += "Q: What is the capital of France?\nA: Paris\n"
        s += "Q: What is the capital of Germany?\nA: Berlin\n"
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", stop="\n", temperature=0)

    ret = few_shot_qa.run(question="What is the capital of the United States?")
    assert "washington" in ret["answer"].strip().lower()
    rets = few_shot_qa.run_batch(
        [{"question": "What is the capital of Japan?"}, {"question": "What is the capital of the United Kingdom?"},
         {"question": "What is the capital city of China?"}],
        temperature=0.1,
    )
    assert [x["answer"].strip().lower() for x in rets] == ["tokyo", "london", "beijing"]


def test_multi_turn_roles():
    @sgl.function
    def two_turns(s, question_1, question_2):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question_1)
        s += sgl.assistant(sgl.gen("answer_1"))
        with s.user():
            s += question_2
        with s.assistant():
            s += sgl.gen("answer_2")

    ret = two_turns.run(question_1="Write about Hawaii.", question_2="Shorter.", temperature=0.7, max_new_tokens=64)
    assert len(ret.messages()) in [4, 5]
    assert ret.messages()[-1]["role"] == "assistant"


def test_select_true_false():
    @sgl.function
    def true_or_false(s, statement):
        s += "Determine whether the statement below is True, False, or Unknown.\n"
        s += "Statement: " + statement + "\n"
        s += "Answer:" + sgl.select("answer", ["True", "False", "Unknown"])

    ret = true_or_false.run(statement="The capital of Germany is Berlin.")
    assert ret["answer"] == "True"


def test_decode_int_and_dtypes():
    @sgl.function
    def decode_int(s):
        s += "The number of hours in a day is " + sgl.gen_int("hours") + "\n"
        s += "The number of days in a year is " + sgl.gen_int("days") + "\n"

    ret = decode_int.run(temperature=0.1)
    assert int(ret["hours"]) == 42 and int(ret["days"]) == 42  # the fake's integer

    @sgl.function
    def dtype_gen(s):
        s += "Q: What is the full name of DNS?\n"
        s += "A: The full name is " + sgl.gen("str_res", dtype=str, stop="\n") + "\n"
        s += "A: " + sgl.gen("int_res", dtype=int) + "\n"
        s += "A: " + sgl.gen("float_res", dtype=float) + "\n"
        s += "A: " + sgl.gen("bool_res", dtype=bool) + "\n"

    state = dtype_gen.run()
    state["int_res"] = int(state["int_res"])
    state["float_res"] = float(state["float_res"])
    state["bool_res"] = bool(state["bool_res"])
    assert state["int_res"] == 42 and state["float_res"] == 3.14


def test_json_with_var_scope_and_regex():
    from radixrt.frontend.dtype_regex import REGEX_FLOAT, REGEX_INT, REGEX_STR

    @sgl.function
    def decode_json(s):
        s += "Generate a JSON object to describe the basic city information of Paris.\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen(regex=REGEX_STR) + ",\n"
            s += '  "population": ' + sgl.gen(regex=REGEX_INT, stop=[" ", "\n"]) + ",\n"
            s += '  "latitude": ' + sgl.gen(regex=REGEX_FLOAT, stop=[" ", "\n"]) + "\n"
            s += "}"

    ret = decode_json.run(temperature=0.0)
    obj = json.loads(ret["json_output"])
    assert isinstance(obj["name"], str) and isinstance(obj["population"], int)

    @sgl.function
    def decode_json_typed(s):
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen_string() + ",\n"
            s += '  "population": ' + sgl.gen_int() + ",\n"
            s += '  "area": ' + sgl.gen(dtype=int) + "\n"
            s += "}"

    obj = json.loads(decode_json_typed.run(max_new_tokens=64)["json_output"])
    assert obj == {"name": "fake", "population": 42, "area": 42}


def test_variable_reuse_and_tool_use():
    @sgl.function
    def expert_answer(s, question):
        s += "Question: " + question + "\n"
        s += "A good person to answer this question is" + sgl.gen("expert", stop=[".", "\n"]) + ".\n"
        s += "For example," + s["expert"] + " would answer that " + sgl.gen("answer", stop=".") + "."

    ret = expert_answer.run(question="What is the capital of France?", temperature=0.1)
    assert ret["expert"] == " a French geographer"
    assert "For example, a French geographer would answer that" in ret.text()

    def calculate(expression):
        return f"{eval(expression)}"

    @sgl.function
    def tool_use(s, lhs, rhs):
        s += "Question: What is the product of " + str(lhs) + " and " + str(rhs) + "?\n"
        s += "Answer: The answer is calculate(" + sgl.gen("expression", stop=")") + ") = "
        with s.var_scope("answer"):
            s += calculate(s["expression"])

    ret = tool_use(lhs=257, rhs=983, temperature=0)
    assert int(ret["answer"]) == 257 * 983


def test_react_loop_with_select():
    @sgl.function
    def react(s, question):
        s += "Question: " + question + "\n"
        for i in range(1, 5):
            s += f"Thought {i}:" + sgl.gen(stop=[".", "\n"]) + ".\n"
            s += f"Action {i}: " + sgl.select(f"action_{i}", ["Search", "Finish"])
            if s[f"action_{i}"] == "Search":
                s += " [" + sgl.gen(stop="]") + "].\n"
                s += f"Observation {i}:" + sgl.gen(stop=[".", "\n"]) + ".\n"
            else:
                s += " [" + sgl.gen("answer", stop="]") + "].\n"
                break

    ret = react.run(question="What country does the creator of Linux live in?", temperature=0.1)
    assert ret["action_1"] == "Finish"
    assert "finland" in ret["answer"].lower()


def test_parallel_decoding_and_encoding():
    fork_size = 3

    @sgl.function
    def parallel_decoding(s, topic):
        s += "Give some tips for " + topic + ".\n"
        for i in range(1, 1 + fork_size):
            s += f"{i}." + sgl.gen(max_tokens=16, stop=[".", "\n"]) + ".\n"
        forks = s.fork(fork_size)
        for i in range(fork_size):
            forks[i] += f"Now, I expand tip {i+1} into a detailed paragraph:\nTip {i+1}:"
            forks[i] += sgl.gen("detailed_tip", 64, stop=["\n\n"])
        forks.join()
        s += "Here are these tips with detailed explanation:\n"
        for i in range(fork_size):
            s += f"Tip {i+1}:" + forks[i]["detailed_tip"] + "\n"
        s += "\nIn summary," + sgl.gen("summary", max_tokens=512)

    ret = parallel_decoding.run(topic="writing a good blog post", temperature=0.3)
    assert isinstance(ret["summary"], str) and len(ret["detailed_tip"]) == fork_size

    @sgl.function
    def parallel_encoding(s, question, context_0, context_1, context_2):
        s += "USER: Please memorize these statements.\n"
        contexts = [context_0, context_1, context_2]
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "\nQuestion: " + question + "\n"
        s += "ASSISTANT:" + sgl.gen("answer", max_tokens=64)

    ret = parallel_encoding.run(
        question="Who is the father of Julian?", context_0="Ethan is the father of Liam.",
        context_1="Noah is the father of Julian.", context_2="Oliver is the father of Carlos.", temperature=0,
    )
    assert "Statement 1: Noah is the father of Julian.\n" in ret.text()


def test_stream_and_regex_and_spec_decorator():
    @sgl.function
    def qa(s, question):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer"))

    out = "".join(qa(question="Compose a blog post.", stream=True).text_iter())
    assert out.endswith("<|im_end|>\n") and "fine words here." in out
    out = "".join(qa(question="Compose a blog post.", stream=True).text_iter("answer"))
    assert out.startswith(" fine words here.")

    ip = r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"

    @sgl.function
    def regex_gen(s):
        s += "Q: What is the IP address of the Google DNS servers?\n"
        s += "A: " + sgl.gen("answer", temperature=0, regex=ip)

    regex_gen.run().sync()

    @sgl.function(num_api_spec_tokens=64)
    def gen_character_spec(s):
        s += "Name:" + sgl.gen("name", stop="\n") + "\nBirthday:" + sgl.gen("birthday", stop="\n")

    assert gen_character_spec().error() is None


def test_batch_select_with_threads_and_progress_bar():
    few_shot_examples = "".join(f"Context {i}: then this happened.\n\n" for i in range(10))

    @sgl.function
    def few_shot_hellaswag(s, question, choices):
        s += few_shot_examples + question
        s += sgl.select("answer", choices=choices)

    arguments = [{"question": f"Story {i}: the next step is", "choices": [" Search", " Finish", " Wait"]}
                 for i in range(8)]
    rets = few_shot_hellaswag.run_batch(arguments, temperature=0, num_threads=64, progress_bar=True)
    assert [r["answer"] for r in rets] == [" Finish"] * 8


def test_min_tokens_is_forwarded(backend):
    @sgl.function
    def convo(s):
        s += sgl.user("What is the capital of the United States?")
        s += sgl.assistant(sgl.gen("answer", min_tokens=8, max_tokens=16))
        s += sgl.user("A number?")
        s += sgl.assistant(sgl.gen_int("n", min_tokens=1, max_tokens=16))

    convo.run().sync()
    assert backend.requests[0]["sampling_params"]["min_new_tokens"] == 8
    assert backend.requests[1]["sampling_params"]["min_new_tokens"] == 1
