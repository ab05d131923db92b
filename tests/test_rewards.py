"""GSM8K answer extraction and math-verify accuracy: formats, and no input that raises or hangs."""

import random
import string
import time

import pytest

from trl_a3po.rewards import (
    extract_final_answer,
    gsm8k_accuracy_reward,
    gsm8k_correct_format_reward,
    gsm8k_format_reward,
    reference_answer,
)


GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("so the total is \\boxed{72}", "72"),
        ("\\boxed{\\$1,234.50}", "1234.50"),
        ("\\boxed{18 \\text{ dollars}}", "18"),
        ("\\boxed{72.}", "72"),
        ("first \\boxed{3} then \\boxed{72}", "72"),
        ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("work...\n#### 1,000", "1000"),
        ("The answer is 42.", "42"),
        ("the answer is: $17", "17"),
        ("She has 5 apples and 7 pears, 12 fruits.", "12"),
        ("-3 degrees", "-3"),
        ("no digits here", None),
        ("", None),
        ("\\boxed{", None),
    ],
)
def test_extract_final_answer(completion, expected):
    assert extract_final_answer(completion) == expected


def test_reference_answer_reads_after_hashes():
    assert reference_answer(GOLD) == "72"
    assert reference_answer("blah\n#### 1,234") == "1234"
    assert reference_answer("#### -5") == "-5"


def test_accuracy_reward_values():
    completions = [
        "\\boxed{72}",
        "#### 72.0",
        "The answer is 72 clips.",
        "\\boxed{\\frac{144}{2}}",  # math-verify evaluates the expression
        "\\boxed{71}",
        "I think 72, no wait, 73",
        "",
    ]
    assert gsm8k_accuracy_reward(completions, [GOLD] * len(completions)) == [1, 1, 1, 1, 0, 0, 0]


def test_conversational_completions_and_format_reward():
    conversational = [[{"role": "assistant", "content": "\\boxed{72}"}], [{"role": "assistant", "content": "72"}]]
    assert gsm8k_accuracy_reward(conversational, [GOLD, GOLD]) == [1.0, 1.0]
    assert gsm8k_format_reward(conversational) == [1.0, 0.0]


def test_correct_format_reward_pays_only_a_boxed_correct_answer():
    # boxed+right, boxed+wrong (the answer a format-only bonus pays for), unboxed+right, unboxed+wrong, boxed garbage
    completions = ["so \\boxed{72}", "\\boxed{71}", "The answer is 72", "71", "\\boxed{}"]
    assert gsm8k_correct_format_reward(completions, [GOLD] * 5) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert gsm8k_format_reward(completions) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert gsm8k_accuracy_reward(completions, [GOLD] * 5) == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_reward_signature_plugs_into_trl():
    # TRL calls reward functions with keyword arguments, including columns it does not know
    assert gsm8k_accuracy_reward(
        prompts=["q"], completions=["\\boxed{72}"], answer=[GOLD], completion_ids=[[1]], trainer_state=None
    ) == [1.0]


def adversarial_strings(rng):
    yield "x" * 200_000
    yield "\\boxed{" * 5_000
    yield "}" * 5_000 + "\\boxed{1}"
    yield "\\boxed{" + "{" * 3_000 + "7" + "}" * 3_000 + "}"
    yield "9" * 50_000
    yield "1," * 20_000
    yield "\\boxed{\\frac{1}{0}}"
    yield "\\boxed{10^{10^{10^{10}}}}"
    yield "\\boxed{" + "+".join(["x"] * 2000) + "}"
    yield "The answer is " + "٣" * 100  # Arabic-Indic digits
    yield "\x00\x01\ufffd\U0001f600 #### 72"
    yield "####"
    yield "$$$$\\$\\$"
    for _ in range(300):
        alphabet = string.printable + "\\{}$#٣€½🙂"
        yield "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 400)))


def test_fuzz_never_raises_and_stays_fast():
    rng = random.Random(0)
    for text in adversarial_strings(rng):
        start = time.perf_counter()
        rewards = gsm8k_accuracy_reward([text], [GOLD])
        assert rewards in ([0.0], [1.0])
        assert gsm8k_format_reward([text]) in ([0.0], [1.0])
        assert time.perf_counter() - start < 10, repr(text[:80])
    # and a malformed reference costs nothing either
    assert gsm8k_accuracy_reward(["\\boxed{1}"], ["no hashes at all {"]) == [0.0]
