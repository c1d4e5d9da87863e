"""/v1/embeddings through a real `localllm serve` with the official openai client: 64 single requests
(one after another) against one request of the same 64 inputs, interleaved, in the same run.

    python scripts/bench_embeddings.py MODEL [--rounds 5] [--inputs 64] [--port 8097]

Starts the server (numba backend, its defaults), waits for /health, warms up, then times each round's
two ways back to back and prints mean ± sd, the ratio, milliseconds per input token, the time of a
one-token request (what a request costs beyond its tokens, at most), and the load average.
The inputs are sentences of realistic length (~20-30 tokens each).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx
import openai

SUBJECTS = ["The committee", "A small bakery", "Our new intern", "The river", "An old lighthouse",
            "The quarterly report", "My neighbour's dog", "The research team"]  # fmt: skip
ACTIONS = [
    "reviewed the proposal before the deadline", "opened a second shop near the station",
    "fixed the flaky test in the payment service", "flooded the lower fields after the storm",
    "was restored by volunteers over two summers", "shows revenue growing for the third time",
    "barks at every bicycle that passes the gate", "published their findings on soil bacteria",
]  # fmt: skip
ENDINGS = ["and everyone agreed it was worth it.", "although nobody expected it to work.",
           "so the plans for next year have changed.", "which surprised the local newspaper."]  # fmt: skip


def sentences(n: int) -> list[str]:
    return [f"{SUBJECTS[i % 8]} {ACTIONS[(i * 3) % 8]}, {ENDINGS[(i * 5) % 4]} (note {i})" for i in range(n)]


def start_server(model: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "localllm", "serve", model, "--port", str(port), "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise SystemExit("the server did not become ready in 600 s")


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--port", type=int, default=8097)
    args = ap.parse_args()
    texts = sentences(args.inputs)
    proc = start_server(args.model, args.port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none")
        model = client.models.list().data[0].id
        tokens = client.embeddings.create(model=model, input=texts).usage.prompt_tokens  # warm-up
        client.embeddings.create(model=model, input=texts[0])
        singles, batched, tiny = [], [], []
        for _ in range(args.rounds):
            singles.append(timed(lambda: [client.embeddings.create(model=model, input=t) for t in texts]))
            batched.append(timed(lambda: client.embeddings.create(model=model, input=texts)))
            # a one-token input: the request's own cost (HTTP, JSON, tokenizing, the engine hand-off)
            # plus a one-token forward pass, an upper bound on what batching can save per request
            tiny.append(timed(lambda: [client.embeddings.create(model=model, input=[1]) for _ in texts]))
    finally:
        proc.terminate()
        proc.wait(30)

    def show(xs: list[float]) -> str:
        return f"{statistics.mean(xs):.3f} ± {statistics.pstdev(xs):.3f} s"

    ratios = [s / b for s, b in zip(singles, batched, strict=True)]
    single, batch = statistics.mean(singles), statistics.mean(batched)
    print(f"{model}: {args.inputs} inputs, {tokens} tokens ({tokens / args.inputs:.1f} per input)")
    print(f"  {args.inputs} single requests: {show(singles)} ({single / tokens * 1e3:.2f} ms/token)")
    print(f"  one request of {args.inputs}: {show(batched)} ({batch / tokens * 1e3:.2f} ms/token)")
    print(f"  ratio {single / batch:.2f}x (per round {min(ratios):.2f}-{max(ratios):.2f})")
    print(f"  a one-token request: {statistics.mean(tiny) / len(texts) * 1e3:.1f} ms (overhead bound)")
    print("  load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
