"""Example (a): a math agent on OpenAI's official Python SDK, one call per episode.

The AgentJet client runs this once per episode with OPENAI_BASE_URL (its local proxy) and
OPENAI_API_KEY (a token naming the episode) set, so `OpenAI()` needs no arguments; the
task comes as JSON in AGENTJET_TASK (and on stdin). The last stdout line is the reward.

    {"id": "add-17-25", "data": {"a": 17, "b": 25}}

Sampling temperature: AGENT_TEMPERATURE (default 0.7; SmolLM2-135M at 1.0 rarely answers
right, so groups would carry no signal). The logprobs the trainer uses are the model's own.
"""

import json
import os
import re

from openai import OpenAI

task = json.loads(os.environ["AGENTJET_TASK"])
a, b = task["data"]["a"], task["data"]["b"]
model = task["data"].get("model", os.environ.get("AGENTJET_MODEL", "smollm2"))

client = OpenAI()
reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
    max_tokens=32,
    temperature=float(os.environ.get("AGENT_TEMPERATURE", "0.7")),
)
answer = reply.choices[0].message.content or ""
numbers = re.findall(r"-?\d+", answer.replace(",", ""))
correct = bool(numbers) and int(numbers[-1]) == a + b
print(f"{a} + {b} -> {answer!r}")
print(json.dumps({"reward": 1.0 if correct else 0.0}))
