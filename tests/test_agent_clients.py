"""What agent frameworks send, through their own clients, on SmolLM2 (a model that never
thinks) with no reasoning parser and with qwen3's: the verdicts must be the same. An
openai-agents ``Agent`` with a pydantic ``output_type`` and ``responses.parse`` get a whole
answer of the model's schema (its numbers bounded, so greedy SmolLM2 cannot write digits until
max_tokens); an agent forced to call its tool calls it; a streamed Responses function call cut
by max_tokens is never sent, as the same answer not streamed."""

from __future__ import annotations

import asyncio

import openai
import pytest
from pydantic import BaseModel

from engine.tools.live_server import MODEL, LiveServer

agents = pytest.importorskip("agents")


class CityFacts(BaseModel):
    city: str
    population: int
    area_km2: float


ASK = "Give the population and area of Paris."
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}  # fmt: skip


@pytest.fixture(scope="module", params=[None, "qwen3"])
def server(smollm2, request):
    parser = {} if request.param is None else {"reasoning_parser": request.param}
    with LiveServer(smollm2, backend="cpu", max_model_len=1024, num_gpu_blocks=256, **parser) as s:
        yield s


def _model(server):
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    return agents.OpenAIResponsesModel(model=MODEL, openai_client=client)


def test_an_agents_output_type_comes_back_whole(server):
    settings = agents.ModelSettings(temperature=0, max_tokens=120)
    agent = agents.Agent(name="facts", instructions="Answer as JSON.", output_type=CityFacts,
                         model=_model(server), model_settings=settings)  # fmt: skip
    result = asyncio.run(agents.Runner.run(agent, ASK, max_turns=1))
    assert isinstance(result.final_output, CityFacts), result.final_output
    assert result.final_output.city


def test_responses_parse_reads_the_model(server):
    r = server.openai_client().responses.parse(
        model=MODEL, input=ASK, text_format=CityFacts, temperature=0, max_output_tokens=120
    )
    assert r.status == "completed" and isinstance(r.output_parsed, CityFacts), r.output_text


def test_an_agent_forced_to_call_its_tool_calls_it(server):
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    settings = agents.ModelSettings(temperature=0, max_tokens=60, tool_choice="required")
    agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather],
                         model=_model(server), model_settings=settings,
                         tool_use_behavior="stop_on_first_tool")  # fmt: skip
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=2))
    assert seen and result.final_output == f"Sunny in {seen[0]}"


def test_a_cut_function_call_is_not_sent_streamed_or_not(server):
    client = server.openai_client()
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
              tool_choice={"type": "function", "name": "get_weather"}, temperature=0)  # fmt: skip
    whole = client.responses.create(**kw, max_output_tokens=60)
    calls = [o for o in whole.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].arguments.startswith("{")
    n = whole.usage.output_tokens // 2
    cut = client.responses.create(**kw, max_output_tokens=n)
    assert cut.status == "incomplete"
    assert not [o for o in cut.output if o.type == "function_call"]
    streamed, final = [], None
    with client.responses.stream(**kw, max_output_tokens=n) as stream:
        for event in stream:
            if event.type == "response.output_item.added":
                streamed.append(event.item.type)
            if event.type == "response.incomplete":  # the stream's end, as OpenAI's
                final = event.response
    assert "function_call" not in streamed and final.output_text == cut.output_text
