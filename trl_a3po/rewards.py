"""GSM8K rewards with TRL's reward-function signature: `f(completions, answer, **kwargs) -> list[float]`.

The final answer is read from the completion (`\\boxed{...}`, then `#### n`, then `The answer is n`, then the last
number), cleaned of commas, `$`, units and trailing periods, and compared to the reference (the number after
`####` in GSM8K's `answer` column) with math-verify. No input makes these functions raise or run long: the text
handed to math-verify is a short extracted span, and math-verify's own timeouts apply.
"""

from __future__ import annotations

import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_HASHES = re.compile(rf"####\s*\$?\s*({_NUMBER})")
_ANSWER_IS = re.compile(rf"answer\s+is\s*:?\s*\$?\s*\\?\$?\s*({_NUMBER})", re.IGNORECASE)
_LAST_NUMBER = re.compile(_NUMBER)
_DECORATION = re.compile(r"\\(?:text|mathrm|textbf)\{[^{}]*\}|\\[$%,!;]|[$%]|\b[a-zA-Z]+\b\.?")
_MAX_SPAN = 200  # longest answer span handed to math-verify
_TIMEOUT_S = 2
_EXTRACTION = [LatexExtractionConfig(), ExprExtractionConfig()]


def completion_text(completion) -> str:
    """A completion as TRL passes it: a string, or (conversational) a list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    return str(completion)


def reference_answer(answer: str) -> str:
    """GSM8K's reference: the number after '####' (commas removed); the whole string if there is no '####'."""
    tail = answer.split("####")[-1]
    return _clean_number(tail) or tail.strip()


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces; None if there is none or it never closes."""
    start = text.rfind("\\boxed")
    while start != -1:
        open_brace = text.find("{", start)
        if open_brace != -1 and text[start + len("\\boxed") : open_brace].strip() == "":
            depth = 0
            for i in range(open_brace, min(len(text), open_brace + 10 * _MAX_SPAN)):
                if text[i] == "{":
                    depth += 1
                elif text[i] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[open_brace + 1 : i]
        start = text.rfind("\\boxed", 0, start)
    return None


def _clean_number(span: str) -> str | None:
    """'$1,234.50 dollars.' -> '1234.50'; None when the span holds no number."""
    match = _LAST_NUMBER.search(span.replace("\\,", "").replace("{,}", ""))
    if match is None:
        return None
    return match.group(0).replace(",", "").rstrip(".")


def extract_final_answer(completion) -> str | None:
    """The completion's final answer as a short string (a number when one can be found), or None."""
    text = completion_text(completion)
    boxed = _last_boxed(text)
    if boxed is not None:
        # '\$1,234.50', '18 \text{ dollars}', '72.': a decorated number; anything else (\frac{3}{4}) goes to
        # math-verify as written.
        undecorated = _DECORATION.sub(" ", boxed).strip()
        if re.fullmatch(_NUMBER + r"\.?", undecorated):
            return _clean_number(undecorated)
        return boxed[:_MAX_SPAN].strip() or None
    for pattern in (_HASHES, _ANSWER_IS):
        matches = pattern.findall(text)
        if matches:
            return _clean_number(matches[-1])
    numbers = _LAST_NUMBER.findall(text)
    return _clean_number(numbers[-1]) if numbers else None


def _verify(reference: str, prediction: str) -> bool:
    # math-verify's timeouts use SIGALRM, which only the main thread may set: elsewhere, rely on the short span.
    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${reference}$", extraction_config=_EXTRACTION, parsing_timeout=timeout)
    pred = parse(f"${prediction}$", extraction_config=_EXTRACTION, parsing_timeout=timeout)
    return bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)


def _is_correct(completion, reference) -> bool:
    try:
        prediction = extract_final_answer(completion)
        return prediction is not None and _verify(reference_answer(str(reference)), prediction)
    except Exception:  # malformed text must cost the sample its reward, never the training run
        return False


def gsm8k_accuracy_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals the GSM8K reference (math-verify), else 0.0."""
    return [1.0 if _is_correct(c, reference) else 0.0 for c, reference in zip(completions, answer, strict=True)]


def gsm8k_format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion puts a final answer in \\boxed{...}, else 0.0 (optional shaping reward)."""
    return [1.0 if _last_boxed(completion_text(c)) is not None else 0.0 for c in completions]


def gsm8k_correct_format_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final answer is in \\boxed{...} *and* correct, else 0.0: a format bonus that cannot
    be collected without solving the problem (the unconditional one taught small models to box wrong answers)."""
    return [
        1.0 if _last_boxed(completion_text(c)) is not None and _is_correct(c, reference) else 0.0
        for c, reference in zip(completions, answer, strict=True)
    ]
