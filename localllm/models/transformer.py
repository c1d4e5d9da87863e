"""The decoder-only transformer every architecture is: embeddings, the spec'd layers, norm, logits.

An architecture module (llama.py, qwen2.py, gemma3.py) only reads its hyper-parameters into ModelArgs
and names its tensors; this class loads and runs any of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.architectures import TENSOR_NAMES
from localllm.errors import ModelFormatError
from localllm.models.base import ForwardBatch, PagedKV, WeightLoader
from localllm.models.layers import decoder_layer, fused_rows, gathered_rows, load_layer
from localllm.models.spec import ModelArgs

if TYPE_CHECKING:
    from localllm.backends.base import Backend
    from localllm.loading.file import GGUFFile


class Transformer:
    def __init__(
        self, gf: GGUFFile, backend: Backend, args: ModelArgs, names: dict[str, str] | None = None,
        weight_cache: Any = None,
    ):  # fmt: skip
        from localllm.models.checks import check_model

        self.backend = backend
        self.args = args
        check_model(gf, args, names)  # shapes and byte ranges, before any kernel sees a byte
        if any(s.experts for s in args.layers) and not backend.runs_moe:
            raise ModelFormatError(
                f"{gf.path.name}: the {backend.name} backend does not run mixture-of-experts layers "
                f"({args.architecture}); use --backend numba"
            )
        if args.recurrent and not backend.runs_gated_delta:
            raise ModelFormatError(
                f"{gf.path.name}: the {backend.name} backend does not run gated_delta_net layers "
                f"({args.architecture}); use --backend numba"
            )
        names = {**TENSOR_NAMES, **(names or {})}
        w = WeightLoader(gf, backend, weight_cache)
        self.tok_embd = w.matrix("token_embd.weight")
        self.output = self.tok_embd if args.tied_output else w.matrix("output.weight")
        self.output_norm = w.vector("output_norm.weight")
        fused, ple = {**fused_rows(args), **gathered_rows(args)}, args.per_layer_dim > 0
        self.layers = [load_layer(w, il, spec, names, fused, args.head_dim_of(il), ple)
                       for il, spec in enumerate(args.layers)]  # fmt: skip
        if ple:  # gemma4's per-layer inputs: an embedding and a projection of the input, normed
            self.ple_embd = w.matrix("per_layer_token_embd.weight")
            self.ple_model_proj = w.matrix("per_layer_model_proj.weight")
            self.ple_proj_norm = w.vector("per_layer_proj_norm.weight")
        w.check_all_read(args.spec_tensors)

    def embed(self, input_ids: Any) -> Any:
        x = self.backend.embedding(self.tok_embd, input_ids)
        return x if self.args.embedding_scale == 1.0 else x * np.float32(self.args.embedding_scale)

    def forward_layers(self, x: Any, batch: ForwardBatch, kv: PagedKV) -> Any:
        """Every layer on x: in one fused call where the backend can run this spec, else op by op."""
        fused = self.backend.run_layers(self, x, batch, kv)
        if fused is not None:
            return fused
        per_layer = self.per_layer_inputs(batch.input_ids, x) if self.args.per_layer_dim else None
        for il, lw in enumerate(self.layers):
            own = None if per_layer is None else per_layer[:, il]
            x = decoder_layer(self.backend, self.args, il, lw, x, batch, kv, own)
        return x

    def per_layer_inputs(self, input_ids: Any, x: Any) -> Any:
        """(T, layers, per_layer_dim): each layer's input, as llama.cpp's gemma4 computes it from the
        ids and the scaled embeddings x: (norm(x @ proj / sqrt(dim)) + embd[ids] * sqrt(width)) / sqrt(2)."""
        b, a, f = self.backend, self.args, np.float32
        shape = (x.shape[0], a.n_layers, a.per_layer_dim)
        proj = (b.linear(x, self.ple_model_proj) * (f(1) / np.sqrt(f(a.dim)))).reshape(shape)
        proj = b.rms_norm(proj, self.ple_proj_norm, a.norm_eps)
        embd = b.embedding(self.ple_embd, input_ids).reshape(shape) * np.sqrt(f(a.per_layer_dim))
        return (proj + embd) * (f(1) / np.sqrt(f(2)))

    def hidden_states(self, batch: ForwardBatch, kv: PagedKV) -> Any:
        """The final normed hidden states (len(batch.logits_indices), dim) of the rows that need them:
        what the output projection reads, and what embeddings pool."""
        b = self.backend
        batch = b.begin_step(batch, self)
        x = self.forward_layers(self.embed(batch.input_ids), batch, kv)
        return b.rms_norm(x[batch.logits_indices], self.output_norm, self.args.norm_eps)

    def forward(self, batch: ForwardBatch, kv: PagedKV) -> Any:
        """Logits (len(batch.logits_indices), vocab) for the rows that need them."""
        b = self.backend
        logits = b.linear_precise(self.hidden_states(batch, kv), self.output)
        cap = self.args.final_logit_softcap
        return logits if not cap else b.softcap(logits, cap)
