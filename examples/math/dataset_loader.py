"""GSM8K rows -> areno rows (use with --dataset-loader-fn examples/math/dataset_loader.py).

A GSM8K row is {"question": str, "answer": str}, where `answer` is a worked
solution ending in "#### <final answer>". `load_row` returns
    prompt:   the question plus an instruction on where to put the answer
    answer:   the final answer (text after "####", commas removed), for the reward
    question, solution: the original fields, kept for the reward or the logs
"""

INSTRUCTION = (
    "Solve the problem step by step. Then give the final answer as a number "
    "on the last line, after '####', like this:\n#### 42"
)


def final_answer(solution: str) -> str:
    """'... #### 1,234' -> '1234'."""
    return solution.rsplit("####", 1)[-1].strip().replace(",", "")


def load_row(row: dict) -> dict:
    question, solution = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(solution, str):
        raise ValueError("a GSM8K row needs string fields 'question' and 'answer'")
    if "####" not in solution:
        raise ValueError("the 'answer' field has no '#### <final answer>' line")
    return {
        "prompt": f"{question.strip()}\n\n{INSTRUCTION}",
        "answer": final_answer(solution),
        "question": question,
        "solution": solution,
    }
