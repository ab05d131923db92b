"""Print the README's A3POConfig reference table from the dataclass (tests/test_readme.py checks they agree)."""

import dataclasses

from trl import GRPOConfig

from trl_a3po import A3POConfig


def reference_table() -> str:
    grpo = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    rows = ["| field | default | what it does |", "| --- | --- | --- |"]
    for f in dataclasses.fields(A3POConfig):
        if f.name in grpo and f.default == grpo[f.name].default:
            continue  # GRPOConfig's own fields: see TRL's documentation
        help_text = " ".join(f.metadata.get("help", "").split()).replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{f.default!r}` | {help_text} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_table())
