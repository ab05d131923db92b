"""The README's configuration reference is the dataclass's."""

import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_config_reference_matches_the_dataclass():
    table = runpy.run_path(str(REPO / "scripts" / "config_reference.py"))["reference_table"]()
    assert table in (REPO / "README.md").read_text(), "regenerate with: python scripts/config_reference.py"


def test_readme_commands_exist():
    readme = (REPO / "README.md").read_text()
    for path in ("scripts/setup.sh", "recipes/gsm8k.py", "recipes/gsm8k_cpu.yaml", "recipes/gsm8k.yaml",
                 "recipes/eval_gsm8k.py", "notebooks/quickstart.ipynb", "scripts/install_vllm_cpu.sh"):
        assert path in readme and (REPO / path).exists(), path
