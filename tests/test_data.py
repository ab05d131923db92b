"""GSM8K loading: the easy subset filter, the one-shot prompt, row validation."""

import json
from pathlib import Path

import pytest

from trl_a3po import gsm8k_prompt, load_gsm8k
from trl_a3po.data import ONE_SHOT, solution_steps


LOCAL = Path(__file__).resolve().parent.parent / "recipes" / "data" / "gsm8k"


def rows(path):
    return [json.loads(line) for line in (path).read_text().splitlines() if line.strip()]


def test_solution_steps_counts_calculator_annotations():
    assert solution_steps("Natalia sold 48/2 = <<48/2=24>>24.\nThen 48+24 = <<48+24=72>>72.\n#### 72") == 2
    assert solution_steps("No calculation here.\n#### 5") == 0


def test_easy_subset_keeps_exactly_the_short_solutions_in_file_order_before_the_limit():
    raw = rows(LOCAL / "test.jsonl")
    expected = [r["answer"] for r in raw if r["answer"].count("<<") <= 2]
    subset = load_gsm8k(str(LOCAL), "test", max_solution_steps=2)
    assert subset["answer"] == expected and 0 < len(expected) < len(raw)
    first = load_gsm8k(str(LOCAL), "test", limit=5, max_solution_steps=2)
    assert first["answer"] == expected[:5]  # the limit counts problems of the subset, not of the file


def test_easy_subset_bad_bounds_are_named(tmp_path):
    with pytest.raises(ValueError, match="max_solution_steps must be >= 0"):
        load_gsm8k(str(LOCAL), "test", max_solution_steps=-1)
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q?", "answer": "<<1+1=2>>2\n#### 2"}) + "\n")
    with pytest.raises(ValueError, match="no GSM8K problem .* has <= 0 solution steps"):
        load_gsm8k(str(tmp_path), "train", max_solution_steps=0)


def test_one_shot_prompt_puts_the_worked_example_before_the_question():
    plain = gsm8k_prompt("How many?")
    shot = gsm8k_prompt("How many?", one_shot=True)
    assert shot == ONE_SHOT + plain and len(plain) == 1 and plain[0]["role"] == "user"
    assert [m["role"] for m in shot] == ["user", "assistant", "user"]
    assert shot[1]["content"].endswith("\\boxed{54}.")
    dataset = load_gsm8k(str(LOCAL), "test", limit=2, one_shot=True)
    assert all(p[:2] == ONE_SHOT and len(p) == 3 for p in dataset["prompt"])


def test_malformed_row_is_named_by_its_line_even_past_the_limit(tmp_path):
    good = {"question": "q?", "answer": "#### 1"}
    lines = [good, good, {"question": "q?", "answer": "no reference"}]
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    with pytest.raises(ValueError, match=r"test.jsonl, line 3: malformed row: it needs a non-empty 'question'"):
        load_gsm8k(str(tmp_path), "test", limit=1)


def test_a_line_that_is_not_json_is_named_by_file_and_line(tmp_path):
    good = json.dumps({"question": "q?", "answer": "#### 1"})
    # a blank line, then a line truncated mid-record (line 4 of the file, the 3rd record)
    (tmp_path / "train.jsonl").write_text(f"{good}\n\n{good}\n{good[:20]}\n{good}\n")
    with pytest.raises(ValueError) as info:
        load_gsm8k(str(tmp_path), "train")
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'train.jsonl'}, line 4: not valid JSON")
    assert info.value.__cause__ is None and "pyarrow" not in message  # one clear error, no parser traceback
    # rows after a blank line are named by their real line too
    (tmp_path / "train.jsonl").write_text(f"{good}\n\n" + json.dumps({"question": "", "answer": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl, line 3: malformed row"):
        load_gsm8k(str(tmp_path), "train")


def test_addition_dataset_is_seeded_correct_and_held_out(tmp_path):
    from trl_a3po.data import write_addition_dataset

    write_addition_dataset(str(tmp_path / "a"), train_size=300, test_size=50, seed=3)
    write_addition_dataset(str(tmp_path / "b"), train_size=300, test_size=50, seed=3)
    for split in ("train", "test"):
        assert (tmp_path / "a" / f"{split}.jsonl").read_text() == (tmp_path / "b" / f"{split}.jsonl").read_text()
    train, test = load_gsm8k(str(tmp_path / "a"), "train"), load_gsm8k(str(tmp_path / "a"), "test")
    assert len(train) == 300 and len(test) == 50
    questions = {
        split: [p[-1]["content"].split("\n")[0] for p in data["prompt"]]
        for split, data in (("train", train), ("test", test))
    }
    assert not set(questions["train"]) & set(questions["test"])  # held out
    for question, answer in zip(questions["test"], test["answer"]):
        a, b = (int(x) for x in question.removeprefix("What is ").removesuffix("?").split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and answer.endswith(f"#### {a + b}")
    assert solution_steps(test["answer"][0]) == 1
    with pytest.raises(ValueError, match="at most 8100 distinct problems"):
        write_addition_dataset(str(tmp_path / "c"), train_size=8100, test_size=1)


def test_the_committed_addition_task_is_seed_0_of_the_generator(tmp_path):
    """recipes/data/addition (the CPU demo's and the learning benchmark's data) is exactly what the documented
    command writes, so the benchmark's numbers can be reproduced from the generator alone."""
    from trl_a3po.data import write_addition_dataset

    write_addition_dataset(str(tmp_path))
    for split in ("train", "test"):
        assert (LOCAL.parent / "addition" / f"{split}.jsonl").read_text() == (tmp_path / f"{split}.jsonl").read_text()
