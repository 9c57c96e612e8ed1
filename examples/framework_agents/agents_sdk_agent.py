"""A calculator agent on OpenAI's Agents SDK (`openai-agents`), with its default model
class: `OpenAIResponsesModel`, i.e. the Responses API (`/v1/responses`). Nothing in it
knows AgentJet: the client's proxy is reached through OPENAI_BASE_URL / OPENAI_API_KEY.

The first model call must use the tool (`tool_choice="required"`; the SDK resets it to
auto after the call, so the next turn answers); the tool result goes back as a
`function_call_output` item.
"""

import asyncio
import os
from typing import Annotated

from agents import Agent, AgentsException, ModelSettings, Runner, function_tool, set_tracing_disabled
from agents.models.openai_responses import OpenAIResponsesModel
from openai import AsyncOpenAI
from pydantic import Field

from calc import EXPRESSION_MAX, MAX_TURNS, calculate, reward, task


@function_tool
def calculator(expression: Annotated[str, Field(max_length=EXPRESSION_MAX)]) -> str:
    """Evaluate an arithmetic expression such as '37 * 48'."""
    out = calculate(expression)
    print(f"calculator({expression!r}) = {out}")
    return out


async def main():
    set_tracing_disabled(True)  # no trace upload: the proxy is the only endpoint
    t, model, question = task()
    agent = Agent(
        name="calculator agent",
        instructions="You answer arithmetic questions with the calculator tool.",
        tools=[calculator],
        model=OpenAIResponsesModel(model=model, openai_client=AsyncOpenAI()),
        model_settings=ModelSettings(tool_choice="required", max_tokens=200,
                                     temperature=float(os.environ.get("AGENT_TEMPERATURE", "0.7"))),
    )
    try:
        result = await Runner.run(agent, question, max_turns=MAX_TURNS)
        final = str(result.final_output)
    except AgentsException as e:  # too many turns, or an answer cut by max_tokens
        print(f"run ended without an answer: {e!r}")
        final = ""
    reward(t, final)


asyncio.run(main())
