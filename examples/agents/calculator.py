"""GSM8K with a calculator tool, as an agent written against the OpenAI API:
the OpenAI tool-calling loop people write, run unchanged against the run's
gateway. The policy calls `calculator` with an arithmetic expression; the agent
answers with its value (a `tool` message) and asks again, until a turn makes
no tool call: that turn's text is the final answer, scored with math-verify
(examples/math/math_verify_reward.py): 1 right, 0 wrong.

    areno train --ckpt SMOLLM2_DIR --dataset-path gsm8k:main \\
        --dataset-loader-fn examples/math/dataset_loader.py \\
        --agent-path examples/agents/calculator.py --max-turns 4 --max-new-tokens 128 \\
        --reward-workers 8 --reward-timeout 600

Tool calls are read from the policy's text by vLLM's hermes parser
(--agent-tool-parser hermes: <tool_call>{"name": ..., "arguments": ...}</tool_call>).
SmolLM2's chat template does not show `tools` to the model, so the system
prompt says the tool and its format; a template that renders tools (Qwen)
shows them as well. The expression is evaluated by examples/tools/calculator_env.py's
`calc` (a syntax-tree walk: no eval()).
"""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

from openai import AsyncOpenAI

_HERE = Path(__file__).resolve().parent


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_calc = _load("areno_example_calculator_env", _HERE.parent / "tools" / "calculator_env.py").calc
_mv = _load("areno_example_math_verify", _HERE.parent / "math" / "math_verify_reward.py")

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
SYSTEM = ("Solve the problem step by step. To compute, call the calculator by writing "
          '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7+3"}}</tool_call> '
          "and wait for its result. End with the final answer as a number.")


async def agent(task):
    client = AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    question = task.row.get("question") or task.row.get("prompt") or task.prompt
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(question)}]
    for _ in range(8):  # the run's --max-turns ends it first: then the answer is empty
        reply = (await client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)).choices[0]
        message = reply.message
        messages.append(message)
        if not message.tool_calls:
            return _mv.reward_fn(SimpleNamespace(answer=task.answer, completion=message.content or ""))
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (ValueError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _calc(str(expression))})
    return 0.0
