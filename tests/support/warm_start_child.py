"""Child process of test_warm_start.py: loads MODEL (the backend's warm-up), then runs generation and
scoring with each thread count the governor may pick; prints, as JSON, the kernels Numba compiled or
loaded from its cache meanwhile (none: the warm-up covered what a first request runs)."""

from __future__ import annotations

import json
import sys

from numba.core.dispatcher import Dispatcher

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.sampling_params import SamplingParams


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    engine = LLMEngine(EngineConfig(model=path, threads=threads, ctx_size=256))
    loaded: list[str] = []
    compile_one = Dispatcher.compile

    def compile_and_note(self: Dispatcher, sig: object) -> object:
        before = len(self.overloads)
        out = compile_one(self, sig)
        if len(self.overloads) > before:
            loaded.append(self.py_func.__qualname__)
        return out

    Dispatcher.compile = compile_and_note  # type: ignore[method-assign]
    governor = engine.backend.thread_governor(engine.model)
    for n in sorted({1, threads}):
        governor.candidates = [n]  # this count for every step from now on
        prompt = [5 + (7 * i + n) % 200 for i in range(40)]
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=3))
        score_tokens(engine, prompt)  # logits of every row: the output projection on 40 rows
    print(json.dumps(loaded))


if __name__ == "__main__":
    main()
