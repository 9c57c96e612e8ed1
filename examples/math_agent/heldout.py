"""Held-out additions answered greedily by a served model: the demo's before/after.

    python heldout.py --base-url http://127.0.0.1:PORT/v1 [--model smollm2]
        [--tasks heldout.jsonl] [--show 6] [--out result.json] [--label before]

Asks every task of --tasks (never trained on: heldout.jsonl holds pairs that tasks.jsonl
does not) with the agents' prompt at temperature 0, all at once (the engine batches
them), and prints the first --show answers, then one line

    heldout <label>: policy version V, R of N right (P%)

The policy version is the one the server answered with (every response says it). --out
writes the same as JSON (version, right, total, answers). Standard library only.
"""

import argparse
import json
import re
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def ask(base_url, model, a, b, max_tokens):
    body = {
        "model": model,
        "messages": [
            {"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    request = urllib.request.Request(
        base_url.rstrip("/") + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.load(response)
    answer = reply["choices"][0]["message"].get("content") or ""
    numbers = re.findall(r"-?\d+", answer.replace(",", ""))
    right = bool(numbers) and int(numbers[-1]) == a + b
    version = reply.get("agentjet", {}).get("policy_version")
    return {"a": a, "b": b, "answer": answer, "right": right, "version": version}


def main():
    here = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tasks", default=f"{here}/heldout.jsonl")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--show", type=int, default=6)
    p.add_argument("--label", default="")
    p.add_argument("--out")
    args = p.parse_args()

    tasks = []
    with open(args.tasks) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    data = json.loads(line)["data"]
                    tasks.append((int(data["a"]), int(data["b"])))
                except (ValueError, KeyError, TypeError) as e:
                    sys.exit(f"{args.tasks}:{n}: not a task with data.a and data.b ({e})")
    if not tasks:
        sys.exit(f"{args.tasks}: no tasks")
    try:
        with ThreadPoolExecutor(max_workers=len(tasks)) as pool:
            results = list(
                pool.map(lambda t: ask(args.base_url, args.model, t[0], t[1], args.max_tokens), tasks)
            )
    except (urllib.error.URLError, OSError) as e:
        sys.exit(f"asking {args.base_url}: {e}")
    versions = sorted({r["version"] for r in results if r["version"] is not None})
    right = sum(r["right"] for r in results)
    for r in results[: args.show]:
        mark = "right" if r["right"] else "wrong"
        print(f"  {r['a']} + {r['b']} = {r['a'] + r['b']:<4} answered {r['answer'][:40]!r:<44} {mark}")
    version = "/".join(map(str, versions)) if versions else "?"
    label = f" {args.label}" if args.label else ""
    print(
        f"heldout{label}: policy version {version}, {right} of {len(results)} right "
        f"({100.0 * right / len(results):.0f}%)"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"versions": versions, "right": right, "total": len(results), "answers": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
