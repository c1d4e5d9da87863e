"""The thread governor picks each step size's faster thread count and follows the machine's load."""

from __future__ import annotations

import time

from localllm.backends.threads import FIRST_PROBE, MAX_PROBE, ThreadGovernor
from localllm.bench.contention import busy_load, label


def _drive(gov: ThreadGovernor, cost: dict[int, float], steps: int, n_tokens: int = 1) -> list[int]:
    """Run `steps` steps whose time per thread count is `cost`; the thread counts chosen."""
    chosen = []
    for _ in range(steps):
        n = gov.choose(n_tokens)
        gov.record(n_tokens, n, cost[n])
        chosen.append(n)
    return chosen


def test_quiet_machine_settles_on_all_threads() -> None:
    gov = ThreadGovernor(2)
    chosen = _drive(gov, {2: 0.008, 1: 0.012}, 200)
    assert chosen[:2] == [2, 1] and gov.current_choice(1) == 2
    assert chosen[2:].count(1) <= 200 // FIRST_PROBE  # only the occasional re-measurement


def test_busy_machine_falls_back_to_one_thread_and_probes_ever_less_often() -> None:
    gov = ThreadGovernor(2)
    chosen = _drive(gov, {2: 0.2, 1: 0.012}, 1000)
    assert gov.current_choice(1) == 1
    probes = [i for i, n in enumerate(chosen) if n == 2][1:]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > MAX_PROBE // 2


def test_load_coming_and_going_is_followed() -> None:
    gov = ThreadGovernor(2)
    _drive(gov, {2: 0.008, 1: 0.012}, 50)
    _drive(gov, {2: 0.2, 1: 0.012}, 20)  # another process starts: the current choice slows down
    assert gov.current_choice(1) == 1
    _drive(gov, {2: 0.008, 1: 0.012}, MAX_PROBE * 2)  # it ends: the next probes find 2 faster
    assert gov.current_choice(1) == 2


def test_step_sizes_are_measured_apart_and_one_thread_needs_no_choice() -> None:
    gov = ThreadGovernor(2)
    _drive(gov, {2: 0.2, 1: 0.012}, 20, n_tokens=1)
    _drive(gov, {2: 0.05, 1: 0.09}, 20, n_tokens=512)
    assert gov.current_choice(1) == 1 and gov.current_choice(512) == 2
    assert ThreadGovernor(1).choose(1) == 1 and ThreadGovernor(4, adaptive=False).choose(7) == 4


def test_busy_load_runs_processes_only_within_its_block() -> None:
    with busy_load(2) as procs:
        time.sleep(0.2)
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)
    assert label("tg128", 1) == "tg128 busy1" and label("tg128", 0) == "tg128"


def test_a_new_small_step_size_starts_from_its_neighbours_choice() -> None:
    """Verify steps bring new sizes: they run the settled neighbour's choice (no 2-thread step on a busy
    machine to find out again) and time the other candidate only at the inherited probe interval."""
    gov = ThreadGovernor(2)
    _drive(gov, {2: 0.2, 1: 0.012}, 100, n_tokens=1)
    chosen = _drive(gov, {2: 0.2, 1: 0.02}, 8, n_tokens=4)
    assert chosen == [1] * 8 and gov.current_choice(4) == 1
    chosen = _drive(gov, {2: 0.01, 1: 0.02}, 300, n_tokens=5)  # the other candidate wins here: found
    assert chosen[0] == 1 and gov.current_choice(5) == 2
    assert _drive(gov, {2: 0.05, 1: 0.09}, 2, n_tokens=512) == [2, 1]  # prefill sizes: measured afresh


def test_one_delayed_step_does_not_flip_a_quiet_machine_to_one_thread() -> None:
    gov = ThreadGovernor(2)
    _drive(gov, {2: 0.008, 1: 0.012}, 20)
    _drive(gov, {2: 0.024, 1: 0.012}, 1)  # another tenant's time slice delays one 2-thread step 3x
    assert gov.current_choice(1) == 2
    _drive(gov, {2: 0.024, 1: 0.012}, 3)  # a sustained slowdown still flips it
    assert gov.current_choice(1) == 1


def test_one_delayed_step_does_not_flip_close_thread_counts() -> None:
    """Where one thread is only ~1.25x slower (Qwen 1.5B: 20.7 vs 26 ms), a running average of the
    2-thread steps crossed the 1-thread figure after one 3x-delayed step; the median does not."""
    gov = ThreadGovernor(2)
    _drive(gov, {2: 0.0207, 1: 0.026}, 40)
    _drive(gov, {2: 0.062, 1: 0.026}, 2)  # two delayed steps in five
    assert gov.current_choice(1) == 2
    _drive(gov, {2: 0.062, 1: 0.026}, 1)  # a third: a sustained slowdown
    assert gov.current_choice(1) == 1


def test_a_probe_step_is_told_from_a_chosen_one() -> None:
    """What speculative decoding asks after each step: did it only re-measure the other thread count?"""
    gov = ThreadGovernor(2)
    flags = []
    for _ in range(3 * FIRST_PROBE):
        n = gov.choose(1)
        gov.record(1, n, {2: 0.008, 1: 0.012}[n])
        flags.append((n, gov.ran_probe(1)))
    settled = flags[2:]  # the first two steps time each candidate: nothing is settled before
    assert all(probe == (n == 1) for n, probe in settled) and any(probe for _, probe in settled)


def test_each_model_has_its_own_governor() -> None:
    """A draft model's steps are timed apart from its target's (engine/draft_model.py)."""
    from localllm.backends.numba_cpu import NumbaBackend
    from localllm.backends.numpy_ref import NumpyBackend

    backend, target, draft = NumbaBackend(2), object(), object()
    assert backend.thread_governor(target) is backend.thread_governor(target)
    assert backend.thread_governor(target) is not backend.thread_governor(draft)
    assert NumpyBackend().thread_governor(target) is None


def test_a_step_from_a_new_thread_runs_the_chosen_thread_count(tiny_model_path) -> None:
    """Numba's thread count is per thread: an engine stepped from another thread (the server's
    AsyncEngine) at -t 1 must launch its kernels with one thread, not the new thread's default."""
    import threading

    import numba

    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.sampling_params import SamplingParams

    if numba.config.NUMBA_NUM_THREADS < 2:
        import pytest

        pytest.skip("needs a machine where Numba starts more than one thread")
    engine = LLMEngine(EngineConfig(model=str(tiny_model_path), threads=1, ctx_size=64))
    seen: list[int] = []
    step = engine.backend.begin_step

    def spy(batch, model):  # type: ignore[no-untyped-def]
        out = step(batch, model)
        seen.append(numba.get_num_threads())
        return out

    engine.backend.begin_step = spy  # type: ignore[method-assign]
    worker = threading.Thread(
        target=lambda: engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
    )
    worker.start()
    worker.join()
    assert seen and set(seen) == {1}


def test_warmup_settles_the_one_token_choice_before_the_first_request(tiny_model_path) -> None:
    """A loaded model's governor already has a measured choice for one-token steps, and Numba is left
    at the backend's count."""
    import numba

    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    if numba.config.NUMBA_NUM_THREADS < 2:
        import pytest

        pytest.skip("needs a machine where Numba starts more than one thread")
    engine = LLMEngine(EngineConfig(model=str(tiny_model_path), threads=2, ctx_size=64))
    assert engine.backend.thread_governor(engine.model).current_choice(1) in (1, 2)
    assert engine.backend.threads == 2 and numba.get_num_threads() == 2


def test_calibration_picks_the_faster_count_for_a_first_short_step() -> None:
    """Where one thread is faster (a loaded machine), a fresh process's first 16-token step (a prompt
    restored from the disk tier) runs with one thread at once, not a try of two first."""
    import time

    from localllm.backends.numba_cpu import CALIBRATION_ROUNDS, NumbaBackend

    backend, model, seen = NumbaBackend(2), object(), []
    if backend.threads < 2:
        import pytest

        pytest.skip("needs a machine where Numba starts more than one thread")

    def step() -> None:
        seen.append(backend.threads)
        time.sleep(0.02 if backend.threads == 2 else 0.002)

    backend._calibrate_threads(model, step)  # type: ignore[arg-type]
    governor = backend.thread_governor(model)  # type: ignore[arg-type]
    assert seen == [2, 1] * CALIBRATION_ROUNDS and backend.threads == 2
    assert governor.current_choice(1) == 1 and governor.choose(16) == 1
    assert ThreadGovernor(2).choose(16) == 2  # (what a fresh governor tries first)


def test_calibration_stops_after_a_round_that_took_long(monkeypatch) -> None:
    """A large model's warm-up step is slow: one round of each count, not CALIBRATION_ROUNDS."""
    from localllm.backends import numba_cpu

    backend, model, seen = numba_cpu.NumbaBackend(2), object(), []
    if backend.threads < 2:
        import pytest

        pytest.skip("needs a machine where Numba starts more than one thread")
    monkeypatch.setattr(numba_cpu, "CALIBRATION_SECONDS", 0.0)
    backend._calibrate_threads(model, lambda: seen.append(backend.threads))  # type: ignore[arg-type]
    assert numba_cpu.CALIBRATION_ROUNDS > 1 and seen == [2, 1]
    assert backend.thread_governor(model).current_choice(1) in (1, 2)  # type: ignore[arg-type]
