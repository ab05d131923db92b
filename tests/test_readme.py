"""The README and docs/: the configuration reference is the dataclass's, the compatibility table names every
GRPOConfig field, the commands name files that exist and carry what the server probe checks, the links resolve."""

import re
import runpy
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))


def docs_text() -> str:
    """The README and every docs/ page, one after the other."""
    return "\n".join(path.read_text() for path in [REPO / "README.md", *DOCS])


def test_config_reference_matches_the_dataclass():
    table = runpy.run_path(str(REPO / "scripts" / "config_reference.py"))["reference_table"]()
    assert table in (REPO / "docs" / "configuration.md").read_text(), (
        "regenerate with: python scripts/config_reference.py --write"
    )


def test_the_readme_is_a_front_door_whose_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in [REPO / "README.md", *DOCS]:
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), (page.name, target)
    linked = set(re.findall(r"\]\(docs/([^)#]+)\)", readme)) | set(
        re.findall(r"\]\(([^)#/]+\.md)\)", (REPO / "docs" / "README.md").read_text())
    )
    assert {path.name for path in DOCS} - {"README.md"} <= linked


def test_readme_commands_exist():
    readme = docs_text()
    for path in (
        "scripts/setup.sh",
        "recipes/gsm8k.py",
        "recipes/gsm8k_cpu.yaml",
        "recipes/gsm8k.yaml",
        "recipes/eval_gsm8k.py",
        "notebooks/quickstart.ipynb",
        "scripts/install_vllm_cpu.sh",
    ):
        assert path in readme and (REPO / path).exists(), path


def server_commands(text: str) -> list[str]:
    """Every vLLM server command in a text (README, yaml comments), its continuation lines joined."""
    joined = re.sub(r"\\\n[#\s]*", " ", text)
    return [
        line
        for line in joined.splitlines()
        if "vllm serve " in line or "trl vllm-serve " in line or "vllm.entrypoints.openai.api_server" in line
    ]


def test_every_server_command_carries_what_the_start_up_probe_checks():
    from trl_a3po.rollout.vllm_server import NCCL_FLAG, SERVER_COMMAND, TRL_SERVE_COMMAND

    texts = [(REPO / "recipes" / name).read_text() for name in ("gsm8k.yaml", "gsm8k_tools.yaml")]
    readme_blocks = "\n".join(re.findall(r"```bash\n(.*?)```", docs_text(), re.S))
    commands = server_commands(readme_blocks) + [c for text in texts for c in server_commands(text)]
    assert len(commands) >= 4, commands
    # TRL's command sets dev mode, processed log-probs and the NCCL engine itself; its default host is 0.0.0.0
    trl_serve = [c for c in commands if "trl vllm-serve " in c]
    assert len(trl_serve) >= 3 and "trl vllm-serve" in readme_blocks.split("vllm serve")[0]  # shown first
    assert "--host 127.0.0.1" in TRL_SERVE_COMMAND and all("--host 127.0.0.1" in c for c in trl_serve), trl_serve
    probe_flags = ["VLLM_SERVER_DEV_MODE=1", "--host 127.0.0.1", "--logprobs-mode processed_logprobs"]
    assert all(flag in SERVER_COMMAND for flag in probe_flags + [NCCL_FLAG.strip()])  # printed by the probe's errors
    for command in commands:
        if "trl vllm-serve " in command:
            continue
        for flag in probe_flags:
            assert flag in command, (flag, command)
        if "vllm serve " in command:  # the GPU commands: NCCL weight transfer
            assert NCCL_FLAG.strip() in command, command


def test_grpo_compatibility_table_names_every_grpoconfig_field_once():
    from dataclasses import fields

    from transformers import TrainingArguments
    from trl import GRPOConfig

    section = (REPO / "docs" / "grpo-compatibility.md").read_text()
    named = []
    for row in section.splitlines():
        if row.startswith("| `"):
            first_cell = row.split("|")[1]
            named += re.findall(r"`([a-z0-9_]+)`", first_cell)
    grpo_fields = [f.name for f in fields(GRPOConfig) if f.name not in {f.name for f in fields(TrainingArguments)}]
    assert sorted(named) == sorted(set(named)), "a field named twice"
    assert set(named) == set(grpo_fields), (set(grpo_fields) - set(named), set(named) - set(grpo_fields))
