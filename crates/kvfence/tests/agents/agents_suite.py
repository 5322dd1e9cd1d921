"""Agent frameworks, unchanged, against a kvfence server: the OpenAI Agents
SDK (an Agent with tools and a structured `output_type`, on its Responses
and Chat Completions models; a run continued by `previous_response_id` and
one kept in a conversation) and LangChain's `with_structured_output` by
JSON schema and by function calling.

Run by the end-to-end test `agents::agent_frameworks_run_unchanged` with
`KVFENCE_BASE_URL` and `KVFENCE_MODEL` set; every check is an assert, and
the script prints the names of the checks that passed. The model is the
random-weight `builtin:tiny`: what is checked is what the server
guarantees — every request accepted, every answer in the shape asked for —
not what a trained model would say.
"""

import asyncio
import json
import os
from typing import Annotated, Literal

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

BASE = os.environ["KVFENCE_BASE_URL"] + "/v1"
MODEL = os.environ["KVFENCE_MODEL"]
client = AsyncOpenAI(base_url=BASE, api_key="unused-locally")
set_tracing_disabled(True)
passed = []
calls = []


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    sky: Literal["sunny", "cloudy", "rainy"]


@function_tool
def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
    """The weather in a city."""
    calls.append(city)
    return "sunny"


def models():
    return {
        "responses": OpenAIResponsesModel(model=MODEL, openai_client=client),
        "chat completions": OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
    }


async def check(name, test):
    await test()
    passed.append(name)


def agent(model, tool_choice, **extra):
    return Agent(
        name="forecaster",
        instructions="Answer with the forecast.",
        tools=[get_weather],
        output_type=Forecast,
        model=model,
        model_settings=ModelSettings(
            tool_choice=tool_choice, temperature=0, max_tokens=120
        ),
        **extra,
    )


def settings():
    return RunConfig(tracing_disabled=True)


async def main():
    for backend, model in models().items():

        async def answers_under_the_schema():
            result = await Runner.run(
                agent(model, "none"), "Weather in Paris?", run_config=settings()
            )
            assert isinstance(result.final_output, Forecast), result.final_output

        async def calls_the_tool():
            calls.clear()
            result = await Runner.run(
                agent(model, "required", tool_use_behavior="stop_on_first_tool"),
                "Weather in Paris?",
                run_config=settings(),
            )
            assert calls and all(len(city) > 0 for city in calls), calls
            assert result.final_output == "sunny", result.final_output

        async def runs_in_auto_mode():
            # A tool call or an answer under the schema, turn after turn:
            # the run ends with a Forecast, or after its turns in calls —
            # never with a refused request or an answer out of shape.
            try:
                result = await Runner.run(
                    agent(model, "auto"), "Weather in Paris?", max_turns=4,
                    run_config=settings(),
                )
                assert isinstance(result.final_output, Forecast), result.final_output
            except MaxTurnsExceeded:
                pass

        await check(f"agents sdk ({backend}): tools with output_type, answering", answers_under_the_schema)
        await check(f"agents sdk ({backend}): tools with output_type, calling", calls_the_tool)
        await check(f"agents sdk ({backend}): tools with output_type, auto", runs_in_auto_mode)

    async def continues_a_stored_response():
        # Under a schema the random model's answers end (an unconstrained
        # one would run to max_tokens, which the SDK treats as a failure).
        plain = agent(models()["responses"], "none")
        first = await Runner.run(plain, "My name is Zed.", run_config=settings())
        assert first.last_response_id, first
        second = await Runner.run(
            plain, "What is my name?", previous_response_id=first.last_response_id,
            run_config=settings(),
        )
        stored = await client.responses.retrieve(second.last_response_id)
        assert stored.previous_response_id == first.last_response_id, stored
        assert stored.usage.input_tokens > first.raw_responses[0].usage.input_tokens, stored

    async def keeps_a_conversation():
        plain = agent(models()["responses"], "none")
        conversation = await client.conversations.create(
            items=[{"type": "message", "role": "user", "content": "My name is Zed."}]
        )
        await Runner.run(plain, "What is my name?", conversation_id=conversation.id,
                         run_config=settings())
        items = await client.conversations.items.list(conversation.id, order="asc")
        kinds = [item.type for item in items.data]
        assert len(kinds) >= 3 and kinds[0] == "message", kinds

    await check("agents sdk: a run continued by previous_response_id", continues_a_stored_response)
    await check("agents sdk: a run kept in a conversation", keeps_a_conversation)

    chat = ChatOpenAI(base_url=BASE, api_key="unused-locally", model=MODEL, temperature=0,
                      max_tokens=200)
    for method in ("json_schema", "function_calling"):

        async def structured():
            answer = await chat.with_structured_output(Forecast, method=method).ainvoke(
                "Weather in Paris?"
            )
            assert isinstance(answer, Forecast), answer

        await check(f"langchain with_structured_output ({method})", structured)


asyncio.run(main())
print(json.dumps(passed))
