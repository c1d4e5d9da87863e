"""Token masks from llguidance: one compiled grammar per distinct spec, one matcher per sequence.

llguidance was chosen by measured per-token cost on this CPU (tests/fixtures/grammar_libs.py; the
figures are in docs/structured-output.md): its mask and its compile are cheap next to a decode step,
and it needs neither torch nor transformers. It is imported here only, when a request is constrained.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from localllm.errors import InvalidRequestError
from localllm.structured.closing import Closers, StringState, closing_token, narrow
from localllm.structured.limits import GrammarLimits, check_bounds
from localllm.structured.sandbox import GrammarSandbox
from localllm.structured.spec import StructuredSpec

CLOSING_TOKENS = 64  # tokens a looping reply gets to close its document before the guard cuts it
# The tokens the document still takes to end are counted again after each token while the budget is
# within this many tokens of them (one token can open a value that needs many more), less often before.
STEER_WINDOW = 16
MAX_CLOSING_PATH = 256  # steps counted at most: a document needing more is treated as needing that many
CLOSED_TO_FIT = "closed_to_fit"  # the finish reason of a document the budget steering changed
CACHE_SIZE = 256  # compiled grammars kept (by spec); a server sees the same few schemas again and again


def lltokenizer(tokenizer: Any) -> Any:
    """llguidance's view of a localllm Tokenizer (built once per tokenizer: it walks the whole vocabulary).

    Control tokens are marked with a 0xFF prefix (llguidance's convention for special tokens) so grammar
    text can never match them; user-defined ones (Qwen's `<tool_call>`) stay plain text."""
    cached = getattr(tokenizer, "_llguidance", None)
    if cached is not None:
        return cached
    import llguidance

    tokens = []
    for i in range(tokenizer.vocab_size):
        data = tokenizer.token_bytes(i)
        tokens.append(b"\xff" + data if tokenizer.is_control(i) else data)
    eos = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids, default=0)
    wrapper = _Wrapper(tokenizer, tokens, eos)
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), eos_token=sorted(tokenizer.eog_ids))
    tokenizer._llguidance = lltok
    return lltok


class _Wrapper:
    """What llguidance.TokenizerWrapper reads: tokens as bytes, eos/bos ids, and a tokenize call."""

    def __init__(self, tokenizer: Any, tokens: list[bytes], eos: int):
        self._tokenizer = tokenizer
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(len(tokens)) if tokenizer.is_control(i)]

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False)


class GrammarCompiler:
    """Compiles specs against one tokenizer and caches a compiled matcher per spec, which each sequence
    copies (thread-safe: the server compiles on request threads, so a bad grammar is a 400 before the
    request reaches the engine). A spec is bounded (limits.py), validated in a child process
    (sandbox.py), then compiled on a thread with a large stack, never on the caller's."""

    def __init__(self, tokenizer: Any, vocab_size: int, limits: GrammarLimits | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.limits = limits or GrammarLimits()
        self.sandbox = GrammarSandbox(self.limits)
        self._cache: OrderedDict[StructuredSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._closers: Closers | None = None
        self._threads: ThreadPoolExecutor | None = None

    def compile(self, spec: StructuredSpec) -> Any:
        """The compiled llguidance matcher for `spec`, in its start state (copy it before use)."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        check_bounds(spec, self.limits)
        grammar = self.sandbox.grammar(spec)
        matcher = self._on_large_stack(_compiled, grammar, lltokenizer(self.tokenizer))
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.name}: invalid {spec.kind}: {_first_line(matcher.get_error())}")
        with self._lock:
            self._cache[spec] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def _on_large_stack(self, fn: Any, *args: Any) -> Any:
        """fn(*args) on one of this compiler's threads, made with `limits.compile_stack` of stack."""
        with self._lock:
            old = threading.stack_size(self.limits.compile_stack)
            try:  # the executor starts its threads inside submit, so they take the size set here
                if self._threads is None:
                    self._threads = ThreadPoolExecutor(2, thread_name_prefix="localllm-grammar")
                future = self._threads.submit(fn, *args)
            finally:
                threading.stack_size(old)
        return future.result()

    def matcher(self, spec: StructuredSpec, budget: int | None = None) -> Constraint:
        """A sequence's constraint; `budget`: the tokens it may generate (max_tokens, or what the
        context leaves), so it can steer the document closed before they run out."""
        eos = self.tokenizer.eos_id if self.tokenizer.eos_id is not None else min(self.tokenizer.eog_ids)
        if self._closers is None:
            self._closers = Closers(self.tokenizer, self.vocab_size)
        lltok = lltokenizer(self.tokenizer)
        copy = self.compile(spec).deep_copy()  # microseconds: the compiled grammar is shared
        return Constraint(copy, lltok, self.vocab_size, eos, self._closers, budget)

    def close(self) -> None:
        """Stop the sandbox's child processes and the compile threads."""
        self.sandbox.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False)


def _compiled(grammar: str, lltok: Any) -> Any:
    import llguidance

    return llguidance.LLMatcher(lltok, grammar, log_level=0)


def _first_line(error: str) -> str:
    # llguidance appends its parser state and grammar: the first line says what went wrong
    return error.strip().split("\n")[0]


class Constraint:
    """One sequence's grammar state: the mask of tokens allowed next, advanced by each accepted token."""

    def __init__(
        self,
        matcher: Any,
        lltok: Any,
        vocab_size: int,
        eos_id: int,
        closers: Closers,
        budget: int | None = None,
    ):
        self._matcher = matcher  # an llguidance.LLMatcher of this sequence's own
        self._lltok = lltok
        self._closers = closers
        self._string = StringState()
        self.closing = False  # set by start_closing: steer to the end of the document
        self._closing_tokens = 0
        self.vocab_size = vocab_size
        self.bits = np.zeros((max(vocab_size, lltok.vocab_size) + 31) // 32, dtype=np.int32)
        self._fresh = False  # bits hold the mask for the current state
        self.eos_id = eos_id  # what a failed matcher allows, so the request ends
        self.tokens_left = budget  # None: no budget to close before
        self.steered: str | None = None  # CLOSED_TO_FIT or "repetition" once steering changed the reply
        self._needed = 0  # tokens the document took to end, when last counted
        self._recount_in = 0  # tokens until it is counted again
        self._sim_bits = np.zeros_like(self.bits)

    def fill_mask(self) -> None:
        """Compute the mask for the next token into `bits` (releases the GIL: can overlap a forward)."""
        if not self._fresh:
            self._matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
            self._fresh = True

    def allowed(self) -> np.ndarray:
        """A bool per logit: may this token come next?"""
        self.fill_mask()
        flags = np.unpackbits(self.bits.view(np.uint8), bitorder="little")
        return flags[: self.vocab_size].view(bool)

    def mask_logits(self, logits: np.ndarray) -> np.ndarray:
        """`logits` (a copy) with every token the grammar refuses at -inf. Built from the allowed ids:
        np.where over the whole vocabulary costs several times more."""
        allowed = self.allowed()
        if self.closing:
            allowed = narrow(allowed, self._closers, self._string.inside)
        ids = np.flatnonzero(allowed[: logits.shape[0]])
        if ids.size == 0:  # the matcher failed: let only end-of-text through
            ids = np.array([self.eos_id])
        out = np.full(logits.shape[0], -np.inf, dtype=np.float32)
        out[ids] = logits[ids]
        return out

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar refuses it (then the matcher is in error)."""
        self._fresh = False
        self._string.feed(self._lltok.decode_bytes([token_id]))
        self._closing_tokens += self.closing
        if self.tokens_left is not None:
            self.tokens_left -= 1
        return bool(self._matcher.consume_token(token_id))

    def start_closing(self) -> bool:
        """The reply is looping: from now on prefer the tokens that end the document (closing.py).
        False once it has had CLOSING_TOKENS tokens to do so (then the caller ends the request)."""
        self.closing = True
        self.steered = "repetition"  # the loop guard cut the reply short, as it cuts free text
        return self._closing_tokens < CLOSING_TOKENS

    @property
    def finish_reason(self) -> str:
        """Why the reply ended with its document: "stop" when the model wrote all of it, else the
        steering that changed it (the server sends "length" with this as native_finish_reason)."""
        return self.steered or "stop"

    # -- budget steering ----------------------------------------------------------------------------

    def steer(self, token_id: int) -> int:
        """The token to take after the model sampled `token_id` (before accept): that one, unless
        taking it would leave fewer tokens than the document then takes to end; then the next
        token of the shortest way to its end (closing.closing_token), and the reply counts as steered.
        So a document that fits is never touched, and one that does not closes instead of being cut."""
        left = self.tokens_left
        if left is None or self.closing:
            return token_id
        if self._recount_in > 0 and left - self._needed > STEER_WINDOW:
            self._recount_in -= 1
            return token_id
        after, state = self._matcher.deep_copy(), self._string.copy()
        state.feed(self._lltok.decode_bytes([token_id]))
        needed = self._tokens_to_end(after, state, left - 1) if after.consume_token(token_id) else None
        if needed is not None:
            self._needed, self._recount_in = needed, max(8, (left - 1 - needed) // 4)
            return token_id
        steer = closing_token(
            self.allowed(), self._closers, self._string.inside, self._closes_after(self._matcher)
        )
        if steer is None or steer == token_id:
            return token_id
        self.steered, self._recount_in = CLOSED_TO_FIT, 0
        return steer

    def _tokens_to_end(self, matcher: Any, state: StringState, limit: int) -> int | None:
        """Tokens the document takes to end from `matcher`'s state (consumed as it goes) along the
        shortest way closing_token finds (a greedy estimate: a longer way than the model's own makes the
        steering start early); None when that is more than `limit`. An end that is allowed but not
        forced takes one more token: the end-of-text."""
        steps = 0
        while not matcher.is_stopped():
            if matcher.is_accepting():
                steps += 1
                break
            if steps >= limit or matcher.is_error():
                return None
            if steps >= MAX_CLOSING_PATH:  # far from the budget's end: it fits for now
                return steps
            matcher.unsafe_compute_mask_ptr(self._sim_bits.ctypes.data, self._sim_bits.nbytes)
            flags = np.unpackbits(self._sim_bits.view(np.uint8), bitorder="little")[: self.vocab_size]
            token = closing_token(flags.view(bool), self._closers, state.inside, self._closes_after(matcher))
            if token is None or not matcher.consume_token(token):
                return None
            state.feed(self._lltok.decode_bytes([token]))
            steps += 1
        return steps if steps <= limit else None

    def _closes_after(self, matcher: Any) -> Callable[[int], bool]:
        """Whether, after a token from `matcher`'s state, a closing bracket may come next."""

        def closes(token: int) -> bool:
            after = matcher.deep_copy()
            if not after.consume_token(token):
                return False
            if after.is_stopped() or after.is_accepting():
                return True
            after.unsafe_compute_mask_ptr(self._sim_bits.ctypes.data, self._sim_bits.nbytes)
            flags = np.unpackbits(self._sim_bits.view(np.uint8), bitorder="little")[: self.vocab_size]
            return bool((flags.view(bool) & self._closers.close[: self.vocab_size]).any())

        return closes

    @property
    def is_finished(self) -> bool:
        """Nothing but end-of-text can follow (the document is complete), or the matcher failed."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return _first_line(self._matcher.get_error()) if self._matcher.is_error() else ""
