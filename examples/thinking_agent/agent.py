"""Example (e): a multi-turn agent with reasoning on (Qwen3 / Qwen3.5 thinking mode).

Three turns of arithmetic in one conversation. Every request turns the template's
thinking mode on (`chat_template_kwargs`, as vLLM accepts it), so each answer comes back
as `<think>reasoning</think>answer`, and the agent sends each answer back unchanged as
its history. The Qwen3 and Qwen3.5 chat templates drop the reasoning of turns before the
last user query when they render that history; the AgentJet tracker keeps every call
continued from the ids the model sampled, reasoning included (docs/ARCHITECTURE.md,
"Templates that rewrite history"), and the client prints how many later calls continued.

    {"id": "think-17-25-8", "data": {"a": 17, "b": 25, "c": 8}}

Reward: 1 if the last answer, its reasoning set aside, ends in a + b + c. The model's name
comes from AGENTJET_MODEL (default `qwen3`); AGENT_TEMPERATURE sets the temperature
(default 0.7).
"""

import json
import os
import re

from openai import OpenAI

task = json.loads(os.environ["AGENTJET_TASK"])
a, b, c = task["data"]["a"], task["data"]["b"], task["data"]["c"]
model = task["data"].get("model", os.environ.get("AGENTJET_MODEL", "qwen3"))
temperature = float(os.environ.get("AGENT_TEMPERATURE", "0.7"))
client = OpenAI()

messages = []
answer = ""
for question in (f"What is {a} + {b}?", f"And what is that plus {c}?",
                 "Thanks! Say the final number once more."):
    messages.append({"role": "user", "content": question})
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=96, temperature=temperature,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    ).choices[0].message
    answer = reply.content or ""
    # The answer goes back exactly as it came, reasoning included: the template decides
    # what of it to render, the tracker keeps what was sampled.
    messages.append({"role": "assistant", "content": answer})
    print(f"{question} -> {answer!r}")

visible = answer.rsplit("</think>", 1)[-1]
numbers = re.findall(r"-?\d+", visible.replace(",", ""))
right = bool(numbers) and int(numbers[-1]) == a + b + c
print(json.dumps({"reward": 1.0 if right else 0.0}))
