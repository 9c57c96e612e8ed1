"""Example (a'), the demo's agent: the math agent of agent.py on Python's standard library
only (urllib), one chat call per episode.

Why a second one: importing OpenAI's SDK costs about 0.6 s of CPU per process, and the
client starts one process per episode. With 16 episodes at once on a 2-core machine that
is most of a core taken from the server's engine and trainer; this agent starts in about
50 ms. Same task format, prompt and reward as agent.py:

    {"id": "add-17-25", "data": {"a": 17, "b": 25}}

The client gives every episode OPENAI_BASE_URL (its local proxy), OPENAI_API_KEY (a
token naming the episode) and AGENTJET_TASK (the task as JSON). The last stdout line is
the reward: 1 when the last number of the reply is a + b, else 0. Sampling temperature:
AGENT_TEMPERATURE (default 0.7).
"""

import json
import os
import re
import sys
import urllib.error
import urllib.request

task = json.loads(os.environ["AGENTJET_TASK"])
a, b = task["data"]["a"], task["data"]["b"]
model = task["data"].get("model", os.environ.get("AGENTJET_MODEL", "smollm2"))

body = {
    "model": model,
    "messages": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
    "max_tokens": int(os.environ.get("AGENT_MAX_TOKENS", "32")),
    "temperature": float(os.environ.get("AGENT_TEMPERATURE", "0.7")),
}
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
    data=json.dumps(body).encode(),
    headers={
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        "Content-Type": "application/json",
    },
)
try:
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.load(response)
except urllib.error.HTTPError as e:
    # The proxy's error body says what went wrong (OpenAI's error shape); no reward line,
    # so the client aborts the episode instead of training on it.
    sys.exit(f"chat completion failed: HTTP {e.code}: {e.read().decode(errors='replace')}")
answer = reply["choices"][0]["message"].get("content") or ""
numbers = re.findall(r"-?\d+", answer.replace(",", ""))
correct = bool(numbers) and int(numbers[-1]) == a + b
print(f"{a} + {b} -> {answer!r}")
print(json.dumps({"reward": 1.0 if correct else 0.0}))
