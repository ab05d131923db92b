"""GSM8K: loading (hub id or local files) and prompt formatting."""

from __future__ import annotations

import json
import os
import random

from datasets import Dataset, load_dataset


INSTRUCTION = "Solve the problem step by step. Put the final answer, a number, in \\boxed{}."


# One worked exchange shown before the question (`one_shot=True`): small models copy its short form and its
# \boxed{} answer (SmolLM2-135M-Instruct: 0% of greedy answers boxed without it, ~40% with it). Written for this
# project, not taken from GSM8K, so it overlaps no train or test problem.
ONE_SHOT = [
    {
        "role": "user",
        "content": "A baker made 36 muffins in the morning and half as many in the afternoon. How many "
        f"muffins did the baker make in total?\n\n{INSTRUCTION}",
    },
    {
        "role": "assistant",
        "content": "In the afternoon the baker made 36 / 2 = 18 muffins.\nIn total the baker made "
        "36 + 18 = 54 muffins.\nThe answer is \\boxed{54}.",
    },
]


def gsm8k_prompt(question: str, one_shot: bool = False) -> list[dict]:
    """A conversational prompt: TRL renders it with the model's chat template. `one_shot` puts a short worked
    example (`ONE_SHOT`) before the question."""
    return (ONE_SHOT if one_shot else []) + [{"role": "user", "content": f"{question.strip()}\n\n{INSTRUCTION}"}]


def solution_steps(answer: str) -> int:
    """Calculator steps in a GSM8K worked answer: its `<<expression=result>>` annotations."""
    return answer.count("<<")


def _jsonl_lines(path: str) -> list[int]:
    """The 1-based numbers of a jsonl file's non-blank lines (one record each); a line that is not a JSON object
    raises an error naming the file and the line. (datasets reports it as a pyarrow parse error with no line.)"""
    numbers = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}, line {number}: not valid JSON ({error.msg}, column {error.colno}): "
                    f"{line.strip()[:120]!r}"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(record).__name__}")
            numbers.append(number)
    return numbers


def load_gsm8k(
    name_or_path: str = "openai/gsm8k",
    split: str = "train",
    limit: int | None = None,
    max_solution_steps: int | None = None,
    one_shot: bool = False,
) -> Dataset:
    """GSM8K rows as `prompt` (chat messages) + `answer` (GSM8K's worked answer, ending in '#### n').

    `name_or_path`: a hub id (`openai/gsm8k`, config `main`), a folder holding `{split}.jsonl`, or a jsonl file.
    `max_solution_steps`: keep only problems whose reference solution needs at most this many calculator steps
    (GSM8K's `<<...>>` annotations): an easier subset for small models (<= 2 keeps 36% of train, 33% of test).
    The filter runs before `limit`, so `limit=200` means the first 200 problems of the subset.
    `one_shot`: prompts start with a short worked example (see `gsm8k_prompt`).
    """
    path = os.path.join(name_or_path, f"{split}.jsonl") if os.path.isdir(name_or_path) else name_or_path
    if os.path.isdir(name_or_path) and not os.path.exists(path):
        raise FileNotFoundError(f"GSM8K folder {name_or_path!r} has no {split}.jsonl")
    if os.path.isfile(path):
        lines = _jsonl_lines(path)  # a clear error for a line that is not JSON, before datasets' pyarrow one
        dataset = load_dataset("json", data_files=path, split="train")
        where = [f"{path}, line {number}" for number in lines]
    else:
        dataset = load_dataset(name_or_path, "main", split=split)
        where = [f"row {index} of {name_or_path!r} ({split})" for index in range(len(dataset))]
    for column in ("question", "answer"):
        if column not in dataset.column_names:
            raise ValueError(f"GSM8K data at {path!r} has no {column!r} column (has {dataset.column_names})")
    # Every row is checked before any filter or limit, so the message names the row's place in the file.
    for index, row in enumerate(dataset):
        if not isinstance(row["question"], str) or not row["question"].strip() or "####" not in str(row["answer"]):
            raise ValueError(
                f"GSM8K data, {where[index]}: malformed row: it needs a non-empty 'question' and an 'answer' ending "
                f"in '#### <number>'; got {dict(row)!r:.300}"
            )
    if max_solution_steps is not None:
        if max_solution_steps < 0:
            raise ValueError(f"max_solution_steps must be >= 0 (or None for all problems), got {max_solution_steps}")
        dataset = dataset.filter(lambda row: solution_steps(str(row["answer"])) <= max_solution_steps)
        if len(dataset) == 0:
            raise ValueError(
                f"no GSM8K problem of {name_or_path!r} ({split}) has <= {max_solution_steps} solution steps"
            )
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return dataset.map(lambda row: {"prompt": gsm8k_prompt(row["question"], one_shot)}, remove_columns=["question"])


def write_addition_dataset(folder: str, train_size: int = 2000, test_size: int = 200, seed: int = 0) -> str:
    """Write a synthetic GSM8K-format task to `folder` (train.jsonl, test.jsonl): "What is a + b?" for two-digit a
    and b, drawn with `seed`; no (a, b) pair of the test split occurs in the train split. An easy task whose accuracy
    a 135M model can move on a CPU budget (SmolLM2-135M-Instruct, one-shot prompt: 13% greedy on seed 0's test split
    before training; `recipes/data/addition` is seed 0's output). The answers carry GSM8K's `<<a+b=c>>` annotation
    and `#### c`, so every loader, reward and evaluation here reads it. Returns the folder."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    if train_size + test_size > len(pairs):
        raise ValueError(f"at most {len(pairs)} distinct problems: train_size + test_size = {train_size + test_size}")
    os.makedirs(folder, exist_ok=True)
    splits = {"test": pairs[:test_size], "train": pairs[test_size : test_size + train_size]}
    for split, chosen in splits.items():
        with open(os.path.join(folder, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for a, b in chosen:
                answer = f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"
                f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": answer}) + "\n")
    return folder


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write the synthetic addition task (train.jsonl, test.jsonl).")
    parser.add_argument("folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--test-size", type=int, default=200)
    cli = parser.parse_args()
    print(write_addition_dataset(cli.folder, cli.train_size, cli.test_size, cli.seed))
