"""scripts/heldout_conformance.py: every file it writes is a model localllm opens as the architecture it
names (the comparison itself needs a llama.cpp build, which the tests do not have)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "heldout_conformance.py"


def test_every_case_writes_a_model_of_its_architecture(tmp_path: Path) -> None:
    from localllm.loading.file import GGUFFile

    spec = importlib.util.spec_from_file_location("heldout_conformance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cases = module.cases()
    assert len(cases) >= 20
    for i, (name, (write, _)) in enumerate(cases.items()):
        family = name.split()[0].split("_")[0]  # "gemma4_e seed 21" -> gemma4
        gf = GGUFFile.open(write(tmp_path / f"{i}.gguf"))
        assert gf.architecture == {"gptoss": "gpt-oss"}.get(family, family), name
