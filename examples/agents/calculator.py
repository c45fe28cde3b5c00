"""Tool use: multiply numbers beyond the tiny policy's reach by calling a calculator.

The agent is an ordinary OpenAI-client program: it sends the question with a `calc` tool,
runs the tool calls the policy makes, and sends the results back until the policy answers.
asyncrl serves it through the per-episode proxy (ctx.openai()), records every token, and scores
the final answer with the task's verifier (the agent returns None).

The warm start teaches the format from demonstrations that call the tool only 40% of the time
and otherwise guess; RL finds that calling the tool pays (reward ~0.4 -> ~0.9).
"""
from __future__ import annotations

import ast
import operator
import random

from asyncrl.agents import tool

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only integers with + - * are allowed")


@tool(timeout=2.0)
def calc(expression: str) -> str:
    """Evaluate an integer arithmetic expression with + - *."""
    return str(_evaluate(ast.parse(expression.strip(), mode="eval").body))


async def agent(task: dict, ctx):
    client = ctx.openai()
    messages = [{"role": "user", "content": task["prompt"].rstrip("=")}]
    for _ in range(3):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[calc.schema]
        )
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return None  # the verifier scores the final reply
        messages += await ctx.call_tools(message.tool_calls, [calc])
    return 0.0  # never answered


def demos(rng: random.Random) -> dict:
    """One supervised conversation: the tool used right 40% of the time, a guess otherwise."""
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    question, product = f"{a}*{b}", a * b
    messages = [{"role": "user", "content": question}]
    if rng.random() < 0.4:
        call = {"type": "function", "function": {"name": "calc", "arguments": {"expression": question}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": str(product)}]
        answer = product
    else:  # a confident guess of the right size, almost always wrong
        answer = int(product * rng.uniform(0.8, 1.2))
    messages.append({"role": "assistant", "content": str(answer)})
    return {"messages": messages, "tools": [calc.schema]}


def exact(completion: str, entry: dict) -> float:
    """The verifier: the exact product (the dataset's own gives partial credit to near misses,
    which a policy learns to game by appending digits)."""
    return float(completion.strip() == entry["answer"])
