"""LoadedModel: a GGUF model made ready to run, the one way the engine's model and a draft model are opened.

`LoadedModel.open(path, backend, config)` opens the file (its parsed index cached in config.index_dir),
reads its tokenizer, builds the model (the backend's disk cache of prepared weights passed to the load,
and saved once it finished), gives it a paged KV cache with its BlockManager and a ModelRunner, and
warms the backend up for it. With `target`, the model is that target's draft: its vocabulary must be
the target's (whose tokenizer it shares), its pool has as many blocks, and its output layer scores only
the ids a draft may propose (head_ids). This is the only module that opens GGUF files for the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.config import EngineConfig
from localllm.engine.block_identity import model_fingerprint
from localllm.engine.block_manager import BlockManager
from localllm.engine.kv_cache import KVCache, KVLayout
from localllm.engine.model_runner import ModelRunner
from localllm.engine.state_cache import (
    StateCache,
    StateLayout,
    StateSlots,
    StateSnapshots,
    pool_slots,
    snapshot_slots,
)
from localllm.errors import ConfigError

if TYPE_CHECKING:
    from localllm.backends.base import Backend
    from localllm.loading.file import GGUFFile
    from localllm.models.spec import ModelArgs
    from localllm.models.transformer import Transformer
    from localllm.tokenizer.base import Tokenizer

log = logging.getLogger("localllm")


@dataclass(slots=True)
class LoadedModel:
    gguf: GGUFFile  # the GGUFFile, kept open: embeddings and a draft's head read it after the load
    model: Transformer
    tokenizer: Tokenizer
    max_model_len: int
    kv_cache: KVCache
    block_manager: BlockManager
    runner: ModelRunner
    head_ids: np.ndarray | None = None  # the ids a restricted output layer scores, in its row order

    @property
    def args(self) -> ModelArgs:
        return self.model.args

    @property
    def backend(self) -> Backend:
        return self.model.backend

    @classmethod
    def open(
        cls, path: str | Path, backend: Backend, config: EngineConfig, target: LoadedModel | None = None
    ) -> LoadedModel:
        """The model at `path` on `backend`, as `config` says; with `target`, as that model's draft."""
        from localllm.loading.file import GGUFFile

        gguf = GGUFFile.open(path, config.index_dir)
        if target is None:
            tokenizer, max_model_len = _tokenizer(gguf), context_length(gguf, config)
            model = _read_model(gguf, backend, config.index_dir, max_model_len)
            if (warning := model.args.context_warning(max_model_len)) is not None:
                log.warning(warning)
            ids = None
        else:
            check_same_vocabulary(target.gguf, gguf)  # before the load: a wrong draft fails at once
            tokenizer, max_model_len = target.tokenizer, target.max_model_len
            model = _read_model(gguf, backend, config.index_dir, None)  # its trained context's RoPE
            ids = _restrict_head(gguf, model, target, config.draft_vocab)
        gguf.release_pages()  # copies (packed, vectors) replace what the load read of the file
        layout = KVLayout.of(model.args, (config.cache_type_k, config.cache_type_v))
        if target is None:
            num_blocks = pool_blocks(config, max_model_len, layout.bytes_per_token)
        else:  # as large as the target's: every target sequence may have a shadow here
            num_blocks = target.block_manager.num_blocks
        states, slots, snapshots = _state_pool(model, config, target)
        kv_cache = KVCache(backend, layout, num_blocks, config.block_size, states)
        fingerprint = model_fingerprint(gguf, backend, layout, max_model_len, config.block_size)
        blocks = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, fingerprint, slots, snapshots
        )
        if target is None and config.kv_disk_mb and config.enable_prefix_caching:
            blocks.tier = open_disk_tier(config, kv_cache, fingerprint)
        backend.warmup(model, layout.cache_types)
        return cls(gguf, model, tokenizer, max_model_len, kv_cache, blocks, ModelRunner(model, kv_cache), ids)


def _state_pool(
    model: Transformer, config: EngineConfig, target: LoadedModel | None
) -> tuple[StateCache | None, StateSlots | None, StateSnapshots | None]:
    """The recurrent state pool, its bookkeeping and (with prefix caching) its snapshots, for a model
    with recurrent layers; Nones for others."""
    layout = StateLayout.of(model.args)
    if layout is None:
        return None, None, None
    if target is not None:
        raise ConfigError(f"a draft model with recurrent layers ({model.args.architecture}) is not supported")
    n = pool_slots(config.max_num_seqs)
    cache = StateCache(layout, n)
    snaps = (
        StateSnapshots(cache, snapshot_slots(config.max_num_seqs)) if config.enable_prefix_caching else None
    )
    log.info(
        "recurrent state pool: %d slots and %d snapshots of %.1f MiB", n, snaps.num_snapshots if snaps else 0,
        layout.bytes_per_sequence / 2**20,
    )  # fmt: skip
    return cache, StateSlots(n), snaps


def open_disk_tier(config: EngineConfig, kv_cache: KVCache, fingerprint: bytes) -> Any:
    """The prefix cache's disk tier for this model (kv_disk.py), in config.kv_disk_dir or beside the
    index cache (LOCALLLM_HOME/kv-cache)."""
    from localllm.engine.kv_disk import KVDiskTier, default_dir

    if config.kv_disk_dir is not None:
        directory = Path(config.kv_disk_dir)
    elif config.index_dir is not None:
        directory = default_dir(Path(config.index_dir).parent)
    else:
        raise ConfigError("--kv-disk-mb needs a directory: give --kv-disk-dir")
    tier = KVDiskTier(directory, config.kv_disk_mb * 2**20, kv_cache, fingerprint)
    log.info(
        "KV disk cache: %s (%d MiB budget, %d MiB used)", tier.dir, config.kv_disk_mb, tier.budget.used >> 20
    )
    return tier


def context_length(gguf: GGUFFile, config: EngineConfig) -> int:
    """The context the engine runs: config.ctx_size, else the trained one capped at max_default_ctx.
    Known before the model is read: Phi-3's LongRoPE factors depend on it."""
    from localllm.models.base import trained_context

    return config.ctx_size or min(trained_context(gguf), config.max_default_ctx)


def pool_blocks(config: EngineConfig, max_model_len: int, bytes_per_token: int) -> int:
    """Blocks in the KV pool: num_kv_blocks, else kv_cache_mb's worth, else a context per sequence;
    never fewer than one whole context needs."""
    bs = config.block_size
    one_context = -(-max_model_len // bs)
    if config.num_kv_blocks:
        return max(config.num_kv_blocks, one_context)
    if config.kv_cache_mb:
        tokens = config.kv_cache_mb * 2**20 // bytes_per_token
    else:
        tokens = max_model_len * config.max_num_seqs
    return max(int(tokens) // bs, one_context)


def _tokenizer(gguf: GGUFFile) -> Tokenizer:
    from localllm.tokenizer import load_tokenizer

    return load_tokenizer(gguf.metadata)


def _read_model(gguf: GGUFFile, backend: Backend, cache_dir: Path | None, n_ctx: int | None) -> Transformer:
    """The model, its prepared weights from the backend's disk cache in cache_dir when it keeps one;
    the cache is saved only after a load that finished, never with a half-loaded model's."""
    from localllm.models import load_model

    cache = backend.open_weight_cache(gguf, cache_dir) if cache_dir is not None else None
    model = load_model(gguf, backend, n_ctx, cache)
    if cache is not None:
        cache.save()
    return model


def _restrict_head(gguf: GGUFFile, model: Transformer, target: LoadedModel, limit: int) -> np.ndarray | None:
    """Restrict a draft's output layer to head_ids (packed anew each load: a copy of some rows has no
    place in the file or its cache); the ids, or None when it keeps every row."""
    rows = min(target.args.vocab_size, model.args.vocab_size)
    ids = head_ids(target.tokenizer, rows, limit)
    if ids is not None:
        model.output = restricted_head(gguf, model, ids)
    return ids


def check_same_vocabulary(target: GGUFFile, draft: GGUFFile) -> None:
    """Refuse a draft model whose token list differs from the target's: its ids would mean other text."""
    ours = list(target.metadata.get("tokenizer.ggml.tokens") or [])
    theirs = list(draft.metadata.get("tokenizer.ggml.tokens") or [])
    if ours == theirs and ours:
        return
    where = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    detail = (
        f"token {where} is {theirs[where]!r} there and {ours[where]!r} here"
        if where is not None
        else f"{len(theirs)} tokens there, {len(ours)} here"
    )
    raise ConfigError(
        f"the draft model {draft.path.name} does not share {target.path.name}'s vocabulary ({detail}); "
        "a draft model must use the same tokenizer"
    )


def head_ids(tokenizer: Tokenizer, vocab_size: int, limit: int) -> np.ndarray | None:
    """The token ids the draft's output layer scores (None: all of them): the first `limit` ids and every
    special one. Byte-level BPE vocabularies list tokens in merge order, which follows their frequency
    in the tokenizer's corpus: Qwen2.5's first 32,768 ids hold 93% of the tokens of localllm's own code
    and 95% of its README. A token outside is never drafted (its position is a rejection, as a wrong
    draft's), while the layer reads a fraction of its rows (FR-Spec, Zhao et al. 2025, does the same with
    counted frequencies)."""
    if limit <= 0 or limit >= vocab_size:
        return None
    special = [i for i in range(limit, vocab_size) if tokenizer.is_special(i) or tokenizer.is_eog(i)]
    return np.concatenate([np.arange(limit, dtype=np.int64), np.asarray(special, dtype=np.int64)])


def restricted_head(gguf: GGUFFile, model: Transformer, ids: np.ndarray) -> Any:
    """model's output layer restricted to the rows of `ids` (a packed copy of those rows)."""
    name = "token_embd.weight" if model.args.tied_output else "output.weight"
    raw = gguf.raw(name)
    return model.backend.prepare_weight(np.ascontiguousarray(raw[ids]), gguf.tensors[name].ggml_type)
