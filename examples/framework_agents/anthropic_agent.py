"""A calculator agent on Anthropic's SDK (`anthropic`, the Messages API `/v1/messages`),
the tool loop as Anthropic documents it: `tool_use` blocks in, `tool_result` blocks back.
The client's proxy is reached through ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY.
"""

import os

import anthropic

from calc import EXPRESSION_MAX, MAX_TURNS, calculate, reward, task

TOOLS = [{
    "name": "calculator",
    "description": "Evaluate an arithmetic expression such as '37 * 48'.",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": EXPRESSION_MAX}},
                     "required": ["expression"]},
}]

t, model, question = task()
client = anthropic.Anthropic(max_retries=0)
messages = [{"role": "user", "content": question}]
final = ""
for turn in range(MAX_TURNS):
    # The first turn must call the tool ("any"); later turns choose.
    reply = client.messages.create(
        model=model, max_tokens=200, tools=TOOLS, messages=messages,
        tool_choice={"type": "any"} if turn == 0 else {"type": "auto"},
        # This SDK takes no sampling arguments; the API reads them from the body.
        extra_body={"temperature": float(os.environ.get("AGENT_TEMPERATURE", "0.7"))})
    messages.append({"role": "assistant", "content": reply.content})
    uses = [b for b in reply.content if b.type == "tool_use"]
    if not uses:
        final = "".join(b.text for b in reply.content if b.type == "text")
        break
    results = []
    for u in uses:
        out = calculate(u.input.get("expression", ""))
        print(f"turn {turn}: calculator({u.input}) = {out}")
        results.append({"type": "tool_result", "tool_use_id": u.id, "content": out})
    messages.append({"role": "user", "content": results})
reward(t, final)
