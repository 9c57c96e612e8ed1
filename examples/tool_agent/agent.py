"""Example (b): a multi-turn agent with a calculator tool, on OpenAI's Python SDK.

Each episode is a short conversation: the model calls `calculator` (the first turn
requires a tool call; later turns may call it again or answer) through `tools` /
`tool_calls`; the agent evaluates the expression and sends the result back as a `tool`
message; the loop ends when the model answers in text (or after MAX_TURNS calls). Every
call goes through the client's proxy, which tracks the episode token-in-token-out, so the
turns merge into one timeline. Reward: the last number of the final answer equals the
task's answer.

    {"id": "mul-37-48", "data": {"question": "What is 37 * 48?", "answer": 1776}}
"""

import ast
import json
import operator
import os
import re

from openai import OpenAI

MAX_TURNS = 4
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.USub: operator.neg}


def calc(expr: str) -> str:
    """Evaluates + - * / on numbers only (no names, no calls)."""
    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in OPS:
            return OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and type(n.op) in OPS:
            return OPS[type(n.op)](ev(n.operand))
        raise ValueError("only numbers and + - * /")
    try:
        v = ev(ast.parse(expr, mode="eval"))
        return str(int(v)) if float(v).is_integer() else str(v)
    except Exception as e:  # the model sees the error and may try again
        return f"error: {e}"


TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as '37 * 48'.",
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]

task = json.loads(os.environ["AGENTJET_TASK"])
model = task["data"].get("model", os.environ.get("AGENTJET_MODEL", "smollm2"))
client = OpenAI()
messages = [{"role": "user",
             "content": task["data"]["question"] + " Use the calculator, then give the number."}]
final = ""
for turn in range(MAX_TURNS):
    # The first turn must call the tool (constrained decoding makes a small model comply);
    # later turns choose between another call and the answer.
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=64,
        tool_choice="required" if turn == 0 else "auto",
        temperature=float(os.environ.get("AGENT_TEMPERATURE", "0.7")))
    msg = reply.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    if not msg.tool_calls:
        final = msg.content or ""
        break
    for call in msg.tool_calls:
        try:
            args = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError:
            args = {}
        result = calc(str(args.get("expression", "")))
        print(f"turn {turn}: calculator({args.get('expression')!r}) = {result}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
numbers = re.findall(r"-?\d+", final.replace(",", ""))
correct = bool(numbers) and int(numbers[-1]) == task["data"]["answer"]
print(f"final: {final!r}")
print(json.dumps({"reward": 1.0 if correct else 0.0}))
