"""The backend seam is checked, not only declared: mypy (settings in pyproject.toml's [tool.mypy]) finds
no error in the engine, models and backends packages, and does find a wrong call across the seam
(a Backend operation that does not exist, a string where a Backend or a GGUF file belongs).

mypy runs in a subprocess with a cache shared by this module's tests, so the second run reuses the
first one's analysis of localllm.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("localllm/engine", "localllm/models", "localllm/backends")

pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy_cache")


def mypy(cache_dir: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    """mypy on `targets` with the project's settings, run from the repository root."""
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    command += ["--cache-dir", str(cache_dir), "--no-color-output", "--no-error-summary", *targets]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_engine_models_and_backends_type_check(cache_dir: Path):
    result = mypy(cache_dir, *CHECKED)
    assert result.returncode == 0, "mypy errors:\n" + result.stdout + result.stderr


# Each line marked `# wrong` is a wrong call across the seam that mypy must report.
WRONG_CALLS = """
    from localllm.backends import make_backend
    from localllm.loading.file import GGUFFile
    from localllm.models import load_model
    from localllm.models.layers import dense_ffn


    def misuse(gf: GGUFFile) -> None:
        backend = make_backend("numpy", 1)
        backend.matmul_fused(1, 2)  # wrong
        model = load_model(gf, "numpy")  # wrong
        load_model("model.gguf", backend)  # wrong
        model.backend.rms_norm(1, 2)  # wrong
        dense_ffn("numpy", model.args.layers[0], model.layers[0], None)  # wrong
        model.forward(model.args, None)  # wrong
"""


def test_a_wrong_call_across_the_seam_is_reported(cache_dir: Path, tmp_path: Path):
    snippet = tmp_path / "misuse.py"
    snippet.write_text(textwrap.dedent(WRONG_CALLS), encoding="utf-8")
    result = mypy(cache_dir, str(snippet))
    assert result.returncode == 1, result.stdout + result.stderr
    wrong = {i for i, line in enumerate(snippet.read_text().splitlines(), 1) if line.endswith("# wrong")}
    reported = {int(m) for m in re.findall(r"misuse\.py:(\d+): error", result.stdout)}
    assert reported == wrong, result.stdout
