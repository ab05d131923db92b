"""Print the A3POConfig reference table of docs/configuration.md from the dataclass (tests/test_readme.py checks
they agree; `--write` puts it there)."""

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
    import sys
    from pathlib import Path

    if "--write" in sys.argv:
        page = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
        text = page.read_text()
        start = text.index("| field | default | what it does |")
        end = text.index("\n\n", start) if "\n\n" in text[start:] else len(text.rstrip("\n"))
        page.write_text(text[:start] + reference_table() + text[end:])
    else:
        print(reference_table())
