"""OpenAI's Responses API through the official ``openai`` client (``responses.create`` and
``.stream``) and the ``openai-agents`` SDK against a live server on SmolLM2-135M: text with
instructions, previous_response_id, a function call and its output, text.format's JSON schema,
the streamed events in order, stored responses (GET, DELETE, store false), an incomplete answer,
and every refused field.

Oracle: the same conversation through /v1/chat/completions (greedy, the same server).
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from engine.tools.live_server import MODEL, LiveServer

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
}
ASK = "What is the weather in Paris?"
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(smollm2):
    with LiveServer(smollm2, max_model_len=1024, num_gpu_blocks=256) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def chat_text(client, messages, n: int, **kw) -> tuple[str, object]:
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=n, temperature=0, **kw
    )
    return r.choices[0].message.content or "", r


def test_text_with_instructions_is_the_chat_completion(client):
    r = client.responses.create(
        model=MODEL, input="What is the capital of France?", instructions="Be brief.",
        max_output_tokens=24, temperature=0,
    )  # fmt: skip
    text, want = chat_text(
        client, [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "What is the capital of France?"}], 24,
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == text and [o.type for o in r.output] == ["message"]
    assert r.usage.input_tokens == want.usage.prompt_tokens
    assert r.usage.output_tokens == want.usage.completion_tokens
    assert r.instructions == "Be brief." and r.model == MODEL


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(
        model=MODEL, input="What is the capital of France?", instructions="Be brief.",
        max_output_tokens=24, temperature=0,
    )  # fmt: skip
    second = client.responses.create(
        model=MODEL, input="And of Italy?", previous_response_id=first.id,
        max_output_tokens=24, temperature=0,
    )  # fmt: skip
    text, _ = chat_text(
        client,
        [{"role": "user", "content": "What is the capital of France?"},  # no instructions:
         {"role": "assistant", "content": first.output_text},  # they are not carried over
         {"role": "user", "content": "And of Italy?"}], 24,
    )  # fmt: skip
    assert second.output_text == text and second.previous_response_id == first.id


def test_a_function_call_and_its_output_round_trip(client):
    r = client.responses.create(
        model=MODEL, input=ASK, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=40,
        temperature=0,
    )  # fmt: skip
    assert [o.type for o in r.output] == ["function_call"] and r.status == "completed"
    call = r.output[0]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    items = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]  # fmt: skip
    again = client.responses.create(
        model=MODEL, input=items, tools=[WEATHER], max_output_tokens=20, temperature=0
    )
    calls = [{"id": call.call_id, "type": "function",
              "function": {"name": call.name, "arguments": call.arguments}}]  # fmt: skip
    text, want = chat_text(
        client,
        [{"role": "user", "content": ASK},
         {"role": "assistant", "content": "", "tool_calls": calls},
         {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}], 20,
        tools=[CHAT_WEATHER],
    )  # fmt: skip
    assert again.usage.input_tokens == want.usage.prompt_tokens
    assert again.output_text == text


def test_text_format_json_schema_constrains_the_output(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer"}}, "required": ["name", "age"]}  # fmt: skip
    r = client.responses.create(
        model=MODEL, input="A person as JSON.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
    )  # fmt: skip
    value = json.loads(r.output_text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_streamed_events_come_in_order_and_add_up(client):
    kw = dict(model=MODEL, input="What is the capital of France?", max_output_tokens=16,
              temperature=0)  # fmt: skip
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
    ]  # fmt: skip
    end = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-5:] == [
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", end,
    ]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text


def test_streamed_function_call_arguments_add_up(client):
    kw = dict(model=MODEL, input=ASK, tools=[WEATHER], tool_choice=NAMED,
              max_output_tokens=40, temperature=0)  # fmt: skip
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added"
    assert "response.function_call_arguments.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == final.output[0].arguments and json.loads(deltas)["city"]


def test_stored_responses_get_and_delete(client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(
        model=MODEL, input="hi", max_output_tokens=4, temperature=0, store=False
    )
    with pytest.raises(openai.NotFoundError, match="previous_response_id: no stored response"):
        client.responses.create(
            model=MODEL, input="more", previous_response_id=unstored.id, max_output_tokens=4
        )


def test_a_cut_answer_is_incomplete(client):
    r = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0: built-in tool 'web_search'"),
        ({"background": True}, "background: background responses are not implemented"),
        ({"include": ["reasoning.encrypted_content"]}, "include: 'reasoning.encrypted_content'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0: part type 'input_image' is not supported"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type 'item_reference'"),
        ({"model": "nope"}, "The model `nope` does not exist"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type must be"),
    ],
)  # fmt: skip
def test_what_is_not_implemented_is_a_400_naming_it(client, kw, words):
    error = openai.NotFoundError if "model" in kw else openai.BadRequestError
    with pytest.raises(error) as e:
        client.responses.create(**{"model": MODEL, "input": "hi", "max_output_tokens": 4, **kw})
    assert words in e.value.message


def test_an_openai_agents_agent_runs_its_tool_to_completion(server):
    """The openai-agents SDK's Runner over this server's Responses API: the agent calls its one
    function tool and ends with the tool's answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"Sunny, 21 C in {city}"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Use the tool to answer.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=60, tool_choice="required",
                                            parallel_tool_calls=False),
        tool_use_behavior="stop_on_first_tool",
    )  # fmt: skip
    result = asyncio.run(agents.Runner.run(agent, ASK, max_turns=2))
    assert seen and result.final_output == f"Sunny, 21 C in {seen[0]}"
