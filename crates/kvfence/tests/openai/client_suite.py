"""The official OpenAI Python client against a kvfence server.

Run by the end-to-end test `openai_client::the_official_python_client_works`
with `KVFENCE_BASE_URL` and `KVFENCE_MODEL` set; every check is an assert,
and the script prints the names of the checks that passed.
"""

import json
import math
import os
from typing import Literal

import openai
from openai import OpenAI
from pydantic import BaseModel, Field

client = OpenAI(base_url=os.environ["KVFENCE_BASE_URL"] + "/v1", api_key="unused-locally")
MODEL = os.environ["KVFENCE_MODEL"]
passed = []

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check(name):
    def register(test):
        test()
        passed.append(name)
        return test

    return register


def weather_arguments(text):
    arguments = json.loads(text)
    assert set(arguments) == {"city", "unit"}, arguments
    assert len(arguments["city"]) <= 10 and arguments["unit"] in ("celsius", "fahrenheit")
    return arguments


@check("tool_choice required")
def _():
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=WEATHER, tool_choice="required", max_tokens=300, seed=1
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    weather_arguments(call.function.arguments)


@check("tool_choice named, streamed deltas")
def _():
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=WEATHER,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=300,
        stream=True,
    )
    name, arguments, finish = None, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            name = call.function.name or name
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls", (name, finish)
    weather_arguments(arguments)


@check("tool_choice auto answers")
def _():
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=WEATHER, tool_choice="auto", max_tokens=8
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls"), choice
    assert choice.message.content is not None or choice.message.tool_calls


@check("tool round trip")
def _():
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=WEATHER, tool_choice="required", max_tokens=300
    )
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=WEATHER, max_tokens=6, temperature=0
    )
    assert answer.choices[0].message.content is not None
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool
    score: int = Field(ge=0, le=9)
    word: str = Field(max_length=6)


@check("chat.completions.parse with a Pydantic model")
def _():
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for temperature in (0, 1):
        reply = parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Is the sea salty?"}],
            response_format=Verdict,
            max_tokens=200,
            temperature=temperature,
            seed=4,
        )
        verdict = reply.choices[0].message.parsed
        assert isinstance(verdict, Verdict), reply
        Verdict.model_validate_json(reply.choices[0].message.content)


@check("json_object")
def _():
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=400,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].finish_reason == "length"


@check("logprobs with top_logprobs")
def _():
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=3, temperature=0
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-6
        assert entry.logprob <= 0


@check("echo with logprobs scores the prompt")
def _():
    reply = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=2, temperature=0, echo=True,
        logprobs=1, extra_body={"ignore_eos": True}
    )
    choice = reply.choices[0]
    logprobs = choice.logprobs
    prompt = reply.usage.prompt_tokens
    assert len(logprobs.tokens) == prompt + 2
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert choice.text.startswith("the quick brown fox")
    # vLLM's field through extra_body, read back from the raw answer.
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=1,
        extra_body={"prompt_logprobs": 0}
    )
    listed = json.loads(raw.text)["choices"][0]["prompt_logprobs"]
    assert listed[0] is None and len(listed) == prompt
    for position, scored in zip(listed[1:], logprobs.token_logprobs[1:prompt]):
        assert [entry["logprob"] for entry in position.values()] == [scored]


@check("n=3 with a seed")
def _():
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, n=3, seed=9, temperature=1
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1, texts


@check("penalties change the output")
def _():
    def text(**extra):
        return client.completions.create(
            model=MODEL, prompt="the the the", max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True}, **extra
        ).choices[0].text

    plain = text()
    assert text(frequency_penalty=2.0) != plain
    assert text(presence_penalty=2.0) != plain


@check("models.retrieve")
def _():
    assert client.models.retrieve(MODEL).id == MODEL
    try:
        client.models.retrieve("no-such-model")
        raise AssertionError("an unknown model was found")
    except openai.NotFoundError as error:
        assert error.body["message"], error.body


@check("errors in the envelope")
def _():
    cases = [
        dict(extra_body={"frobnicate": 1}),
        dict(top_logprobs=2),
        dict(tools=WEATHER, tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(response_format={"type": "bogus"}),
        dict(n=50),
    ]
    for extra in cases:
        try:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, **extra)
            raise AssertionError(f"accepted: {extra}")
        except openai.BadRequestError as error:
            assert error.body["type"] == "invalid_request_error", error.body
            assert error.body["param"], error.body
    try:
        client.get("/chat/completions", cast_to=object)
        raise AssertionError("GET on a POST route was accepted")
    except openai.APIStatusError as error:
        assert error.status_code == 405 and error.body["message"], error.body


@check("responses.create, streamed, with a tool round trip")
def _():
    reply = client.responses.create(
        model=MODEL, instructions="Be brief.", input="hello", max_output_tokens=6, temperature=0
    )
    assert reply.status in ("completed", "incomplete"), reply
    assert isinstance(reply.output_text, str)
    # Streamed under a schema, so the answer completes before max_output_tokens.
    shape = {"type": "json_schema", "name": "pick", "strict": True, "schema": {
        "type": "object", "properties": {"pick": {"enum": ["left", "right"]}},
        "required": ["pick"], "additionalProperties": False}}
    deltas, kinds = "", []
    with client.responses.stream(
        model=MODEL, input="left or right?", max_output_tokens=60, temperature=0,
        text={"format": shape},
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas += event.delta
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert deltas == final.output_text, (deltas, final.output_text)
    assert json.loads(final.output_text)["pick"] in ("left", "right")
    tools = [{"type": "function", "name": t["function"]["name"],
              "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in WEATHER]
    called = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=tools, tool_choice="required",
        max_output_tokens=300,
    )
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name == "get_weather"
    weather_arguments(call.arguments)
    after = client.responses.create(
        model=MODEL, tools=tools, max_output_tokens=4,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"},
        ],
    )
    assert after.usage.input_tokens > called.usage.input_tokens


@check("responses.create with logprobs included, streamed too")
def _():
    asked = dict(model=MODEL, input="hello", max_output_tokens=5, temperature=0,
                 include=["message.output_text.logprobs"], top_logprobs=2)
    reply = client.responses.create(**asked)
    part = reply.output[0].content[0]
    assert len(part.logprobs) == reply.usage.output_tokens, part
    for entry in part.logprobs:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
    streamed = []
    with client.responses.stream(**asked) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                streamed += event.logprobs
    assert [e.token for e in streamed] == [e.token for e in part.logprobs]


@check("stored responses: continued, retrieved, input items listed, deleted")
def _():
    first = client.responses.create(
        model=MODEL, input="hello", max_output_tokens=4, temperature=0, store=True
    )
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text, (got, first)
    items = client.responses.input_items.list(first.id)
    assert [item.type for item in items.data] == ["message"], items
    assert items.data[0].content[0].text == "hello", items
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input="again", max_output_tokens=4,
        temperature=0,
    )
    assert second.previous_response_id == first.id, second
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    client.responses.delete(first.id)
    try:
        client.responses.retrieve(first.id)
        raise AssertionError("a deleted response was read")
    except openai.NotFoundError:
        pass


print(json.dumps(passed))
