"""A calculator agent on LangChain's `ChatOpenAI` with a bound tool (chat completions),
the loop written the LangChain way: `bind_tools`, `AIMessage.tool_calls`, `ToolMessage`.
The client's proxy is reached through OPENAI_BASE_URL / OPENAI_API_KEY.
"""

import os
from typing import Annotated

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import Field

from calc import EXPRESSION_MAX, MAX_TURNS, calculate, reward, task


@tool
def calculator(expression: Annotated[str, Field(max_length=EXPRESSION_MAX)]) -> str:
    """Evaluate an arithmetic expression such as '37 * 48'."""
    return calculate(expression)


t, model, question = task()
llm = ChatOpenAI(model=model, base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"],
                 temperature=float(os.environ.get("AGENT_TEMPERATURE", "0.7")), max_tokens=200, max_retries=0)
messages = [HumanMessage(question)]
final = ""
for turn in range(MAX_TURNS):
    # The first turn must call the tool; later turns choose.
    bound = llm.bind_tools([calculator], tool_choice="required" if turn == 0 else "auto")
    ai = bound.invoke(messages)
    messages.append(ai)
    if not ai.tool_calls:
        final = ai.content if isinstance(ai.content, str) else str(ai.content)
        break
    for call in ai.tool_calls:
        out = calculator.invoke(call["args"])
        print(f"turn {turn}: calculator({call['args']}) = {out}")
        messages.append(ToolMessage(out, tool_call_id=call["id"]))
reward(t, final)
