"""The completion runner: a request's prompts through the `Scheduler` as jobs (all submitted or none), answered
whole or streamed as server-sent events; a client that goes away, or `--request-timeout`, cancels its jobs (their
decode rows are freed at once). Requests' CPU work (templates, tokenising, pictures, responses) runs off the event
loop on daemon threads (`nemo_jax.threads`: a stuck call never keeps a stopped server alive)."""

from __future__ import annotations

import asyncio
import functools
import os
import time

from nemo_jax.serve.openai import SSE_DONE, APIError, ChoiceStream, Prompt, check_fields, options, response, sse, usage
from nemo_jax.serve.scheduler import Job
from nemo_jax.threads import DaemonPool

HEALTH_PROBE_S = 2.0  # /health is 503 when the request threads cannot take a call within this


class ClientGone(Exception):
    """The client closed the connection before its response."""


class CompletionRunner:
    def __init__(self, scheduler, metrics, prompts, adapters, *, model_name: str, tokens_as_ids: bool = False,
                 request_timeout: float = 0.0):
        """prompts: a `PromptBuilder`; adapters: an `AdapterRegistry`; request_timeout: seconds a request may take
        (0: no limit)."""
        self.scheduler, self.metrics, self.prompts, self.adapters = scheduler, metrics, prompts, adapters
        self.model_name, self.tokens_as_ids, self.request_timeout = model_name, tokens_as_ids, request_timeout
        self.work = DaemonPool(16, "serve")

    async def off_loop(self, fn, *args):
        """fn(*args) on the request threads, within --request-timeout (503 past it)."""
        fut = asyncio.get_running_loop().run_in_executor(self.work, fn, *args)
        try:
            return await asyncio.wait_for(fut, self.request_timeout or None)
        except asyncio.TimeoutError:
            raise APIError(f"the request did not finish within {self.request_timeout:g} s (--request-timeout)",
                           status=503) from None

    async def serving(self) -> bool:
        """Whether requests can be served now: the engine runs, the server is not draining, and the request
        threads take a call within HEALTH_PROBE_S."""
        if not self.scheduler.alive or self.scheduler.draining:
            return False
        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self.work, int), HEALTH_PROBE_S)
            return True
        except asyncio.TimeoutError:
            return False

    async def complete(self, request, body: dict, *, chat: bool):
        """/v1/chat/completions and /v1/completions: the response JSON, or a stream."""
        check_fields(body, "chat" if chat else "completions")
        adapter = self.adapters.resolve(body.get("model"))
        opt = options(body, chat=chat, tokens_as_ids=self.tokens_as_ids)
        prompts = await self.off_loop(functools.partial(self.prompts.prompts, body, chat=chat,
                                                        top_logprobs=opt.top_logprobs))
        model = body.get("model") or self.model_name
        if opt.stream:
            return self.stream(request, prompts, adapter, opt, chat, model)
        samples = await self.run(request, prompts, adapter)
        return await self.off_loop(functools.partial(response, self.prompts.tok, model, prompts, samples, opt,
                                                     chat=chat))

    def _jobs(self, prompts: list[Prompt], adapter, progress=None) -> tuple[list[Job], list]:
        """Jobs of the prompts, submitted together (all or none), each with a future its result settles."""
        loop = asyncio.get_running_loop()
        jobs, futures = [], []
        for k, p in enumerate(prompts):
            fut = loop.create_future()

            def done(result, fut=fut):
                loop.call_soon_threadsafe(_settle, fut, result)
            jobs.append(Job(p, adapter, done, None if progress is None else
                            (lambda i, t, lp, top, k=k: loop.call_soon_threadsafe(progress, k, i, t, lp, top))))
            futures.append(fut)
        self.scheduler.submit(*jobs)
        return jobs, futures

    def _cancel(self, jobs: list[Job], why: str) -> None:
        if any([self.scheduler.cancel(j) for j in jobs]):
            self.metrics.events[why] += 1

    def _timed_out(self) -> APIError:
        return APIError(f"the request did not finish within {self.request_timeout:g} s (--request-timeout)",
                        status=503)

    async def run(self, request, prompts: list[Prompt], adapter, *, progress=None, abort=None) -> list[list] | None:
        """Every prompt through the scheduler -> each prompt's samples. A client that goes away, or the request
        timeout, cancels them (their rows are freed at once). `progress`: handed each sample's tokens as they come
        (`Job.progress`, on the event loop, with the prompt's index first); `abort`: an asyncio.Event that, once
        set, cancels them too and makes this return None."""
        jobs, futures = self._jobs(prompts, adapter, progress)
        results = asyncio.gather(*futures, return_exceptions=True)  # (a cancelled one: no unretrieved exception)
        gone = asyncio.ensure_future(_disconnected(request))
        waits = [results, gone] + ([asyncio.ensure_future(abort.wait())] if abort is not None else [])
        try:
            done, _ = await asyncio.wait(waits, timeout=self.request_timeout or None,
                                         return_when=asyncio.FIRST_COMPLETED)
            if results in done:
                out = results.result()
                for r in out:
                    if isinstance(r, asyncio.CancelledError):
                        raise ClientGone()
                    if isinstance(r, BaseException):
                        raise r
                return out
            if gone in done:
                self._cancel(jobs, "cancelled")
                raise ClientGone()
            if done:
                self._cancel(jobs, "aborted")
                return None
            self._cancel(jobs, "timed_out")
            raise self._timed_out()
        finally:
            for w in waits[1:]:
                w.cancel()
            for f in futures:  # (the gather then ends with their CancelledErrors as results, nothing unretrieved)
                f.cancel()
            self._cancel(jobs, "cancelled")

    def stream(self, request, prompts: list[Prompt], adapter, opt, chat: bool, model: str):
        """A streamed request: its jobs submitted now (a 429 is an HTTP error, not a stream), the chunks as the
        engine samples them."""
        events: asyncio.Queue = asyncio.Queue()
        jobs, futures = self._jobs(prompts, adapter, progress=lambda *a: events.put_nowait(("tokens",) + a))
        for k, fut in enumerate(futures):
            fut.add_done_callback(lambda f, k=k: events.put_nowait(("done", k, f)))
        return _closing_stream()(self._chunks(events, jobs, prompts, opt, chat, model),
                                 on_close=lambda: self._cancel(jobs, "cancelled"),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _chunks(self, events: asyncio.Queue, jobs, prompts: list[Prompt], opt, chat: bool, model: str):
        tok, timeout = self.prompts.tok, self.request_timeout
        n = len(prompts[0].samples)
        streams = [[ChoiceStream(tok, k * n + i, p, opt, chat=chat) for i in range(n)] for k, p in enumerate(prompts)]
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{os.urandom(16).hex()}"
        created, prompt_tokens = int(time.time()), sum(len(p.tokens) for p in prompts)

        def chunk(choices, **extra):
            c = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                 "created": created, "model": model, "choices": choices}
            if opt.include_usage or opt.continuous_usage:
                c["usage"] = None
            if opt.continuous_usage and choices:
                c["usage"] = usage(prompt_tokens, sum(s.sent_tokens for ss in streams for s in ss))
            c.update(extra)
            return sse(c)
        for k, ss in enumerate(streams):
            for s in ss:
                first = s.first()
                if first is not None:
                    extra = {"prompt_token_ids": list(prompts[k].tokens)} if opt.token_ids and k == 0 else {}
                    yield chunk([first], **extra)
        left = len(prompts)
        deadline = time.monotonic() + timeout if timeout else None
        try:
            while left:
                wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    item = await asyncio.wait_for(events.get(), wait)
                except asyncio.TimeoutError:
                    self._cancel(jobs, "timed_out")
                    raise self._timed_out() from None
                if item[0] == "tokens":
                    _, k, i, toks, lps, top = item
                    part = streams[k][i].add(toks, lps, top)
                    if part is not None:
                        yield chunk([part])
                    continue
                _, k, fut = item
                left -= 1
                result = fut.result()
                if isinstance(result, BaseException):
                    raise result
                for s, sample in zip(streams[k], result):
                    for part in s.finish(sample):
                        yield chunk([part])
            if opt.include_usage:
                yield chunk([], usage=usage(prompt_tokens, sum(s.completion_tokens for ss in streams for s in ss)))
        except APIError as e:
            yield sse(e.body())
        yield SSE_DONE

    def close(self) -> None:
        self.work.shutdown()


def _settle(fut, result):
    if not fut.done():  # (a client that went away cancelled it)
        fut.set_result(result)


async def _disconnected(request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@functools.cache
def _closing_stream():
    """A StreamingResponse that runs `on_close` however it ends (done, client gone, cancelled): a stream that
    never started still frees its jobs."""
    from starlette.responses import StreamingResponse

    class ClosingStream(StreamingResponse):
        def __init__(self, content, *, on_close, **kw):
            super().__init__(content, **kw)
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()
    return ClosingStream
