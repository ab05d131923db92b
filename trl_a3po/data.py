"""GSM8K: loading (hub id or local files) and prompt formatting."""

from __future__ import annotations

import os

from datasets import Dataset, load_dataset

INSTRUCTION = "Solve the problem step by step. Put the final answer, a number, in \\boxed{}."


def gsm8k_prompt(question: str) -> list[dict]:
    """A conversational prompt: TRL renders it with the model's chat template."""
    return [{"role": "user", "content": f"{question.strip()}\n\n{INSTRUCTION}"}]


def load_gsm8k(name_or_path: str = "openai/gsm8k", split: str = "train", limit: int | None = None) -> Dataset:
    """GSM8K rows as `prompt` (chat messages) + `answer` (GSM8K's worked answer, ending in '#### n').

    `name_or_path`: a hub id (`openai/gsm8k`, config `main`), a folder holding `{split}.jsonl`, or a jsonl file.
    """
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, f"{split}.jsonl")
        if not os.path.exists(path):
            raise FileNotFoundError(f"GSM8K folder {name_or_path!r} has no {split}.jsonl")
        dataset = load_dataset("json", data_files=path, split="train")
    elif os.path.isfile(name_or_path):
        dataset = load_dataset("json", data_files=name_or_path, split="train")
    else:
        dataset = load_dataset(name_or_path, "main", split=split)
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    for column in ("question", "answer"):
        if column not in dataset.column_names:
            raise ValueError(f"GSM8K data at {name_or_path!r} has no {column!r} column (has {dataset.column_names})")
    for index, row in enumerate(dataset):
        if not isinstance(row["question"], str) or not row["question"].strip() or "####" not in str(row["answer"]):
            raise ValueError(
                f"GSM8K row {index} of {name_or_path!r} ({split}) is malformed: it needs a non-empty 'question' and "
                f"an 'answer' ending in '#### <number>'; got {dict(row)!r:.300}"
            )
    return dataset.map(lambda row: {"prompt": gsm8k_prompt(row["question"])}, remove_columns=["question"])
