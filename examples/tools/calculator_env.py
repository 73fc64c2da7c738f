"""GSM8K with a calculator tool: a multi-turn environment (--env-path).

The model may write an arithmetic expression in a tag, <calc>12*7+3</calc>;
the environment answers with its value as the next user turn, <result>87</result>,
and the model goes on. A turn without a <calc> tag is its final answer, scored
with math-verify against the row's answer (examples/math/math_verify_reward.py):
1 right, 0 wrong. A trajectory's reward is that final score (--env-reward last
or sum: the tool turns score 0).

    areno train --ckpt SMOLLM2_DIR --dataset-path gsm8k:main \\
        --dataset-loader-fn examples/tools/dataset_loader.py \\
        --env-path examples/tools/calculator_env.py --max-turns 4 --max-new-tokens 128

The expression is evaluated by walking its syntax tree (numbers, + - * / // % **,
parentheses, unary minus): no eval(), no names, exponents and sizes bounded.
"""

import ast
import importlib.util
import operator
import re
from pathlib import Path
from types import SimpleNamespace

_spec = importlib.util.spec_from_file_location(
    "areno_math_verify_reward", Path(__file__).resolve().parent.parent / "math" / "math_verify_reward.py")
_mv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mv)

CALL = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.S)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_ABS = 1e15


def calc(expr: str) -> str:
    """The value of an arithmetic expression as text, or 'error: ...'."""
    try:
        value = _eval(ast.parse(expr.strip().replace(",", ""), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {type(e).__name__}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > 64:
            raise ValueError("exponent too large")
        v = OPS[type(node.op)](a, b)
        if abs(v) > MAX_ABS:
            raise OverflowError("too large")
        return v
    raise ValueError("not arithmetic")


def step(state, completion):
    call = CALL.search(completion)
    if call is not None:  # a tool call: answer it, the model goes on
        return f"<result>{calc(call.group(1))}</result>", 0.0, False
    score = _mv.reward_fn(SimpleNamespace(answer=state.answer, completion=completion))
    return "", score, True
