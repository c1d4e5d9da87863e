"""The river text the perplexity and KL-divergence tests score on the tiny model."""

from __future__ import annotations

from localllm.cli import perplexity as _perplexity  # noqa: F401  (registers the command)

TEXT = (
    "The river ran past the old mill, where the wheel had not turned in years. Children came in the "
    "summer to throw stones into the water and to listen to the frogs. In the autumn the leaves fell "
    "into the stream and were carried down to the town, where the baker's daughter collected the red "
    "ones and pressed them between the pages of her books. Nobody remembered who had built the mill, "
    "but everybody agreed that it should be left standing, because the swallows nested under its roof "
    "and the town would not have been the same without them. When the snow came, the wheel wore a "
    "white cap and the water under the ice kept talking to itself all winter long.\n"
)
