"""The agent clients themselves against a live server (../shared/clients.md lists what they send):
instructor (TOOLS and JSON_SCHEMA modes, raw pydantic schemas with $defs and no strict), langchain's
ChatOpenAI (with_structured_output, bind_tools with a named choice) and openai-agents running a tool
with its chat-completions model and with its default (Responses API) model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from conftest import build_model_dir
from server.app import ServerSettings, create_app
from servers import Served, engine_factory, serve

MODEL = "tiny-llama"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Place(BaseModel):
    city: str = Field(max_length=8)


class Trip(BaseModel):
    """A nested model: pydantic writes it as $defs / $ref, as instructor sends it."""

    origin: Place
    mode: Literal["car", "train"]
    days: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tokenizer_dir) -> Iterator[Served]:
    model = build_model_dir(tmp_path_factory.mktemp("agents") / "m", tokenizer_dir, "LlamaForCausalLM",
                            max_position_embeddings=2048)  # fmt: skip
    factory = engine_factory(model, max_model_len=2048)
    with serve(create_app(ServerSettings(served_model_name=MODEL), factory)) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


MESSAGES = [{"role": "user", "content": "Plan a trip."}]


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])  # JSON mode: the schema only in prose
def test_instructor(client, mode):
    instructor = pytest.importorskip("instructor")
    ic = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    trip = ic.chat.completions.create(
        model=MODEL, response_model=Trip, messages=MESSAGES, max_tokens=120, temperature=0, max_retries=0
    )
    assert isinstance(trip, Trip) and isinstance(trip.origin, Place)


def test_langchain_structured_output_and_bound_tools(srv):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=srv.base + "/v1", api_key="unused", model=MODEL, max_tokens=120, temperature=0)
    assert isinstance(llm.with_structured_output(Trip).invoke("Plan a trip."), Trip)  # json_schema, strict
    assert isinstance(llm.with_structured_output(Trip, method="function_calling").invoke("Plan a trip."), Trip)
    msg = llm.bind_tools([Place], tool_choice="Place").invoke("Where?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "Place"
    Place.model_validate(msg.tool_calls[0]["args"])


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_runs_a_tool(srv, api):
    """With its chat-completions model, and with its default model class (the Responses API, what
    ``OpenAIProvider`` gives unless told otherwise)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
    calls = []

    @agents.function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="unused")
    if api == "responses":
        model = agents.OpenAIProvider(openai_client=client).get_model(MODEL)
        assert type(model).__name__ == "OpenAIResponsesModel"
    else:
        model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    # required first (the model is random: it would not choose a tool by itself); the SDK resets the
    # choice after the call, so the second turn answers in text. The SDK fails an incomplete response,
    # so the end-of-text token is favoured: the forced call still ends where its grammar does, and
    # the answer after it ends at once.
    settings = agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0,
                                    extra_body={"logit_bias": {"1": 100}})  # fmt: skip
    agent = agents.Agent(name="a", instructions="Use the tool.", tools=[weather], model=model, model_settings=settings)
    result = asyncio.run(agents.Runner.run(agent, "Weather in Oslo?", max_turns=4))
    assert len(calls) == 1 and isinstance(result.final_output, str)
