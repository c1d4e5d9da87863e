"""Reading GGUF model files: everything between a path and trusted tensors.

Layered bottom-up, each module importing only those before it (and errors, text_table, printable,
quant, architectures below the package): `index` (the parsed header's records), `checks` (what a
file must satisfy: tensor byte ranges, metadata types and ranges), `parser` (the bounded header
parser), `cache` (the on-disk index cache), `splits` (gguf-split sets), `file` (the `GGUFFile`
facade). Model-shape checks, which need a model's `ModelArgs`, live beside the models
(`localllm.models.checks`). Nothing here imports the models, the engine or anything above them.
"""
