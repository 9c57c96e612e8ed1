"""Example (c): two trainable models in one episode, each with its own reward.

A solver answers an addition; a verifier, shown the solver's answer, says whether it is
right. Both are served (and trained) by their own servers; the client routes each call by
its `model` field and submits each model's timeline with that model's reward:

    solver:   1 if its answer is right
    verifier: 1 if its yes/no verdict matches the truth

The models' names come from AGENTJET_SOLVER_MODEL / AGENTJET_VERIFIER_MODEL (default
`solver` / `verifier`, the names the servers were started with, see examples/README.md).
"""

import json
import os
import re

from openai import OpenAI

solver = os.environ.get("AGENTJET_SOLVER_MODEL", "solver")
verifier = os.environ.get("AGENTJET_VERIFIER_MODEL", "verifier")
temperature = float(os.environ.get("AGENT_TEMPERATURE", "0.7"))
task = json.loads(os.environ["AGENTJET_TASK"])
a, b = task["data"]["a"], task["data"]["b"]
client = OpenAI()

answer = client.chat.completions.create(
    model=solver, max_tokens=32, temperature=temperature,
    messages=[{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
).choices[0].message.content or ""
numbers = re.findall(r"-?\d+", answer.replace(",", ""))
claimed = int(numbers[-1]) if numbers else None
right = claimed == a + b

verdict = client.chat.completions.create(
    model=verifier, max_tokens=8, temperature=temperature,
    messages=[{"role": "user",
               "content": f"Is {a} + {b} = {claimed if claimed is not None else answer.strip()[:20]}? Answer yes or no."}],
).choices[0].message.content or ""
says_yes = verdict.strip().lower().startswith("yes")

print(f"solver: {a} + {b} -> {answer!r}; verifier: {verdict!r}")
print(json.dumps({"rewards": {solver: 1.0 if right else 0.0,
                              verifier: 1.0 if says_yes == right else 0.0}}))
