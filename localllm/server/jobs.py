"""A request's jobs on the engine thread: submission, collection, merged streams and SSE responses, and
`run_on_engine` for model work between steps (prompt scores, embeddings). Shared by every endpoint
module; what they need of the server is a `Submitter` (the engine once ready, the metrics, and the work
in flight that shutdown ends), not the server's whole state."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from localllm.engine.output import StepOutput
from localllm.errors import KVCacheFullError
from localllm.sampling_params import SamplingParams
from localllm.server.errors import APIError, stream_error_of
from localllm.server.metrics import RequestTracker, ServerMetrics
from localllm.server.replies import usage_totals
from localllm.server.streaming import DONE, SSE_HEADERS, ChunkBuilder, sse_error

if TYPE_CHECKING:
    from localllm.engine.async_engine import AsyncEngine

log = logging.getLogger("localllm.server")

CLIENT_CLOSED = 499  # nginx's "client closed request": the response goes nowhere
T = TypeVar("T")


class Submitter:
    """What jobs need of the server: `ready()` (the engine, or the 503 while it loads or shuts down),
    the metrics each job feeds, and the jobs and engine calls in flight, which `interrupt` ends."""

    def __init__(self, ready: Callable[[], AsyncEngine], metrics: ServerMetrics):
        self.ready = ready
        self.metrics = metrics
        self.jobs: set[Job] = set()  # submitted and not yet closed
        self.scoring: set[asyncio.Future] = set()  # results awaited from the engine thread (run_on_engine)

    def interrupt(self, error: Callable[[], BaseException]) -> None:
        """End every job and awaited engine call now with `error()` (the server is shutting down)."""
        for job in list(self.jobs):
            job.interrupt(error())
        for future in list(self.scoring):  # the engine thread may stop before it runs them
            if not future.done():
                future.set_exception(error())


class Job:
    """One submitted request. Outputs arrive on an asyncio queue from the engine thread; `close()`
    (idempotent, synchronous so it works even while the task is being cancelled) aborts it if unfinished."""

    def __init__(
        self,
        submitter: Submitter,
        prompt_ids: list[int],
        params: SamplingParams,
        prefix: str,
        group: str | None = None,
    ):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.group = group or self.id  # the client request it belongs to: the scheduler shares fairly by it
        self.prompt_ids = prompt_ids
        self.params = params
        self.tracker = RequestTracker(submitter.metrics, self.id)
        self._engine = submitter.ready()
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._done = False
        self._jobs = submitter.jobs
        self._started = asyncio.Event()  # the first output (or error) has arrived: the prompt is computed
        loop = asyncio.get_running_loop()

        def put(item: StepOutput | BaseException) -> None:
            self._queue.put_nowait(item)
            self._started.set()

        def sink(item: StepOutput | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(put, item)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

        # Submitting here, not inside the stream, makes a full queue or an oversized prompt an HTTP
        # status instead of an error in the middle of a 200 stream.
        self._engine.submit(prompt_ids, params, sink, self.id, self.group)
        self._jobs.add(self)

    async def started(self) -> None:
        """Until the prompt has been computed (its full KV blocks are then in the prefix cache)."""
        await self._started.wait()

    async def outputs(self) -> AsyncIterator[StepOutput]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._done = True  # the engine already dropped the request, or interrupt() aborted it
                raise item
            self.tracker.observe(item)
            self._done = self._done or item.finished
            yield item
            if item.finished:
                return

    def interrupt(self, error: BaseException) -> None:
        """Abort the request and make its reader raise `error` (the server is shutting down)."""
        self.close()
        self._queue.put_nowait(error)

    def close(self) -> None:
        self._jobs.discard(self)
        if not self._done:
            self._done = True
            self._engine.abort(self.id)
            self.tracker.aborted()


async def _gather(job: Job) -> list[StepOutput]:
    return [out async for out in job.outputs()]


async def _client_gone(request: Request) -> None:
    # The body is already read, so the next ASGI message is http.disconnect when the client leaves.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client left while its request was being worked on: the rest of the work is dropped."""


async def unless_client_gone(work: Awaitable[T], request: Request) -> T:
    """`work`'s result, or ClientGone as soon as the client disconnects (`work` is then cancelled:
    what already runs on the engine thread finishes, nothing after it starts)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone
    return task.result()


async def collect(jobs: list[Job], request: Request) -> list[list[StepOutput]] | None:
    """All outputs of each job of a non-streaming request; None (and the jobs aborted) if the client
    left."""
    gather = asyncio.ensure_future(asyncio.gather(*(_gather(job) for job in jobs)))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gather.cancel()
        gone.cancel()
        for job in jobs:
            job.close()
    if gather.done() and not gather.cancelled():
        return list(gather.result())
    return None


async def merged(jobs: list[Job]) -> AsyncIterator[tuple[int, StepOutput]]:
    """The outputs of several jobs as they come, each with its job's index."""
    streams = [job.outputs() for job in jobs]
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield index, out
                pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for task in pending:
            task.cancel()


@dataclass
class ChatRun:
    """A submitted chat request: its choices' jobs, its prompt, and its tool plan (tool_calls.ToolPlan)."""

    jobs: list[Job]
    prompt_ids: list[int]
    tools: Any = None
    cache_break: dict[str, Any] | None = None  # where the prompt left its conversation's last (cache_breaks)

    def usage(self) -> dict[str, Any]:
        usage = total_usage(self.jobs, [len(self.prompt_ids)], len(self.jobs))
        if self.cache_break is not None:
            usage["prompt_tokens_details"]["cache_break"] = self.cache_break
        return usage


def total_usage(jobs: list[Job], prompt_lens: list[int], n: int = 1) -> dict[str, Any]:
    """Usage of a request as OpenAI counts it: each prompt once (its `n` choices share it), every choice's
    completion; cached tokens are those of each prompt's first choice. With max_tokens 0 there are no jobs."""
    lasts = [job.tracker.last for job in jobs]
    generated = sum(last.generated_tokens for last in lasts if last is not None)
    cached = sum(last.cached_tokens for last in lasts[::n] if last is not None)
    reasoning = sum(last.reasoning_tokens for last in lasts if last is not None)
    return usage_totals(sum(prompt_lens), generated, cached, reasoning)


async def submit_choices(
    submitter: Submitter, prompts: list[list[int]], params: SamplingParams, n: int, prefix: str
) -> list[Job]:
    """`n` jobs per prompt, prompt-major (choice index = prompt * n + j). Each prompt's first job runs
    alone until its prompt is computed; the other n - 1 then find the prompt's full blocks in the prefix
    cache instead of computing it again. Each choice gets its own seed (seed + j). If any submission
    fails (queue full) or the request is cancelled meanwhile, the jobs so far are aborted."""
    jobs: list[Job] = []
    try:
        group = f"{prefix}-{uuid.uuid4().hex}"
        firsts = [Job(submitter, ids, params, prefix, group) for ids in prompts]
        jobs += firsts
        if n > 1:
            await asyncio.gather(*(job.started() for job in firsts))
        for p, ids in enumerate(prompts):
            jobs[p * n + 1 : p * n + 1] = [
                Job(submitter, ids, choice_params(params, j), prefix, group) for j in range(1, n)
            ]
    except BaseException:
        for job in jobs:
            job.close()
        raise
    return jobs


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th choice's parameters: the request's, with seed + j when a seed is given (so choices differ
    and the request stays reproducible)."""
    if params.seed is None or j == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % 2**64)


class EventStream(StreamingResponse):
    """SSE response that aborts its jobs however the response ends: finished, client gone (Starlette
    cancels the body on http.disconnect), or never started."""

    def __init__(self, content: AsyncIterator[bytes], jobs: list[Job]):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.jobs = jobs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.close()


async def events(
    jobs: list[Job],
    chunks: ChunkBuilder,
    head: list[bytes],
    per_output: Callable[[int, StepOutput], Iterator[bytes]],
    totals: Callable[[], dict[str, Any]],
) -> AsyncIterator[bytes]:
    """head, a chunk (or two) per output, the usage chunk if asked for, then [DONE]."""
    try:
        for chunk in head:
            yield chunk
        async for index, out in merged(jobs):
            for chunk in per_output(index, out):
                yield chunk
        for chunk in chunks.usage_tail(totals()):
            yield chunk
    except Exception as e:  # after the 200 header an error can only travel inside the stream
        error = stream_error_of(e)
        if error.code != "server_shutdown":  # begin_shutdown logged those once
            log.warning("%s failed mid-stream: %s", chunks.request_id, e)
        yield sse_error(error.message, error.type, error.code)
    finally:
        for job in jobs:
            job.close()
    yield DONE


async def run_on_engine(submitter: Submitter, fn: Callable[[Any], T]) -> T:
    """`fn(llm)` on the engine thread between steps (work that needs the model outside generation);
    its error is raised here. No free KV blocks for it now is a 503 to retry."""
    engine = submitter.ready()
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def work() -> None:  # on the engine thread
        try:
            result, error = fn(engine.engine), None
        except Exception as e:
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    engine.call_soon(work)
    submitter.scoring.add(done)
    try:
        return await done
    except KVCacheFullError as e:
        raise APIError(
            str(e), 503, "server_error", code="kv_cache_full", headers={"Retry-After": "1"}
        ) from None
    finally:
        submitter.scoring.discard(done)
