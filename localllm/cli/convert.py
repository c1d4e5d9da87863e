"""`localllm convert`: a Hugging Face checkpoint directory -> a GGUF (like llama.cpp's convert_hf_to_gguf)."""

from __future__ import annotations

from typing import Annotated

import typer

from localllm.cli.app import app


@app.command()
def convert(
    hf_dir: Annotated[
        str, typer.Argument(metavar="HF_DIR", help="config.json, *.safetensors and the tokenizer files.")
    ],
    output: Annotated[str, typer.Argument(metavar="OUT", help="The GGUF file to write.")],
    qtype: Annotated[
        str,
        typer.Option("--type", "-q", help="F16, F32, or a quantization type as in `localllm quantize`."),
    ] = "F16",
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite OUT if it exists.")] = False,
) -> None:
    """Convert a llama, qwen2 or gemma3 Hugging Face checkpoint to a GGUF llama.cpp and localllm load.

    Examples:

      localllm convert ./Qwen2.5-0.5B-Instruct qwen2.5-0.5b-f16.gguf

      localllm convert ./SmolLM2-135M-Instruct smollm2-q8_0.gguf --type Q8_0
    """
    from pathlib import Path

    from localllm.convert.convert_hf import convert_hf

    arch, items = convert_hf(hf_dir, output, qtype, force)
    types: dict[str, int] = {}
    for item in items:
        types[item.target] = types.get(item.target, 0) + 1
    mix = ", ".join(f"{count} {name}" for name, count in sorted(types.items()))
    size = Path(output).stat().st_size / 2**20
    print(f"{output}: {arch}, {qtype.upper()}, {size:.1f} MiB (tensors: {mix})")
