"""`localllm quantize`: make a quantized GGUF from an F32/F16/BF16 one, like llama-quantize."""

from __future__ import annotations

from typing import Annotated

import typer

from localllm.cli.app import app


@app.command()
def quantize(
    source: Annotated[str, typer.Argument(metavar="IN", help="The GGUF to quantize (F32, F16 or BF16).")],
    output: Annotated[str, typer.Argument(metavar="OUT", help="The GGUF file to write.")],
    qtype: Annotated[
        str,
        typer.Option(
            "--type",
            "-q",
            help="Q8_0, Q6_K, Q5_K_M, Q4_K_M (= Q5_K, Q4_K), Q5_1, Q5_0, Q4_1, Q4_0, "
            "MXFP4_MOE (= MXFP4: experts MXFP4, the rest Q8_0), F16, F32",
        ),
    ] = "Q8_0",
    allow_requantize: Annotated[
        bool,
        typer.Option("--allow-requantize", help="Accept a quantized input: dequantize, then quantize again."),
    ] = False,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite OUT if it exists.")] = False,
) -> None:
    """Write IN quantized to --type as OUT (all metadata copied; norms and 1-D tensors stay F32).

    Examples:

      localllm quantize model-f16.gguf model-Q4_0.gguf --type Q4_0

      localllm quantize model-Q4_K_M.gguf model-f16.gguf --type F16 --allow-requantize
    """
    from localllm.quant.quantize_gguf import check_target, quantize_file

    target = check_target(qtype)  # a bad type is refused before anything is read
    with _Progress() as progress:
        report = quantize_file(source, output, target, allow_requantize, force, progress)
    mix = ", ".join(f"{count} {name}" for name, count in sorted(report.types.items()))
    mib = 2**20
    print(
        f"{output}: {target}, {report.output_bytes / mib:.1f} MiB from {report.source_bytes / mib:.1f} MiB "
        f"(tensors: {mix})"
    )


class _Progress:
    """A rich progress bar over the tensors on stderr, when it is a terminal."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        console = Console(stderr=True)
        columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn())
        self.bar = Progress(*columns, console=console, disable=not console.is_terminal, transient=True)
        self.task = self.bar.add_task("quantizing", total=None)

    def __enter__(self) -> _Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def __call__(self, done: int, total: int, name: str) -> None:
        from rich.markup import escape

        from localllm.printable import printable

        # a tensor name is the file's: escapes shown, brackets not read as Rich markup
        self.bar.update(self.task, completed=done, total=total, description=escape(printable(name)))
