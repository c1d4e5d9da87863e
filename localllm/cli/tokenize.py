"""`localllm tokenize`: show how a model's tokenizer splits a text."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from localllm.cli import common as c
from localllm.cli.app import app


@app.command()
def tokenize(
    model: Annotated[str, typer.Argument(help="A .gguf path or registry name.")],
    text: Annotated[str, typer.Argument(help="The text to tokenize.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print ids and pieces as JSON.")] = False,
    no_special: Annotated[
        bool, typer.Option("--no-parse-special", help="Treat special-token text as plain text.")
    ] = False,
    add_special: Annotated[bool, typer.Option("--add-special/--no-add-special", help="Add BOS/EOS.")] = True,
) -> None:
    """Print the token ids and pieces of TEXT.

    Examples:

      localllm tokenize smollm2-135m-instruct "Hello, world!"

      localllm tokenize model.gguf "<|im_start|>user" --json
    """
    from localllm.loading.file import GGUFFile
    from localllm.tokenizer import load_tokenizer

    path, _ = c.resolve(model)
    tokenizer = load_tokenizer(GGUFFile.open(path, c.model_home() / "index").metadata)
    ids = tokenizer.encode(text, add_special=add_special, parse_special=not no_special)
    pieces = [tokenizer.token_bytes(i).decode("utf-8", errors="backslashreplace") for i in ids]
    if as_json:
        print(json.dumps({"ids": ids, "pieces": pieces}, ensure_ascii=False))
        return
    for token_id, piece in zip(ids, pieces, strict=True):
        print(f"{token_id:>8} {piece!r}")
    print(f"{len(ids)} tokens")
