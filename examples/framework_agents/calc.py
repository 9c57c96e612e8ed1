"""The calculator the three framework agents share (numbers and + - * / only), and their
reward: 1.0 when the last number of the final answer equals the task's answer; otherwise
0.1 when the calculator ran at least once without error (a format reward: an untrained
135M model rarely answers right, and a group whose rewards are all 0 teaches nothing)."""

import ast
import json
import operator
import os
import re

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.USub: operator.neg}
MAX_TURNS = 4
# The expression's longest length: the schema says it, so a forced call cannot ramble.
EXPRESSION_MAX = 40
# Calls of `calculate` that returned a number, for the format reward.
_calls_ok = 0


def calculate(expression: str) -> str:
    """Evaluates + - * / on numbers only (no names, no calls); errors come back as text."""
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
    global _calls_ok
    try:
        v = ev(ast.parse(str(expression), mode="eval"))
        _calls_ok += 1
        return str(int(v)) if float(v).is_integer() else str(v)
    except Exception as e:  # the model sees the error and may try again
        return f"error: {e}"


def task():
    t = json.loads(os.environ["AGENTJET_TASK"])
    model = t["data"].get("model", os.environ.get("AGENTJET_MODEL", "smollm2"))
    question = t["data"]["question"] + " Use the calculator, then give the number."
    return t, model, question


def reward(t, final: str) -> None:
    """Prints the reward line the client reads."""
    numbers = re.findall(r"-?\d+", (final or "").replace(",", ""))
    correct = bool(numbers) and int(numbers[-1]) == t["data"]["answer"]
    print(f"final: {final!r}")
    print(json.dumps({"reward": 1.0 if correct else 0.1 if _calls_ok else 0.0}))
