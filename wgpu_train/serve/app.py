"""The HTTP application (starlette): /v1/models, /v1/chat/completions and /v1/completions over a Scheduler,
streamed as server-sent events or answered whole; the API key checked on every request; every refusal an
OpenAI error object with its 4xx status, and a bug a 500 without its traceback, the server serving on."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from wgpu_train.serve.api_error import ApiError
from wgpu_train.serve.prompts import COMPLETION_TOKENS, budget, chat_prompt_ids, completion_prompt_ids
from wgpu_train.serve.requests import json_body, parse_chat, parse_completion
from wgpu_train.serve.responses import DONE, Reply, model_card, model_list, sse
from wgpu_train.serve.scheduler import Job, QueueFull, Scheduler

log = logging.getLogger("wgpu_train.serve")
RETRY_AFTER_S = 1               # what a 503 (the queue is full) asks the client to wait


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class ApiKeyCheck:
    """ASGI middleware: every HTTP request must carry `Authorization: Bearer <key>`, else a 401."""

    def __init__(self, app, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                refusal = ApiError(401, "incorrect or missing API key: send the header Authorization: Bearer <key>",
                                   code="invalid_api_key")
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: ApiError):
    return error_response(exc)


async def _http_error(request: Request, exc: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code))


async def _internal_error(request: Request, exc: Exception):
    # the traceback goes to the server's log (starlette re-raises to uvicorn), not to the client
    return error_response(ApiError(500, f"internal server error ({type(exc).__name__})"))


async def _disconnected(request: Request):
    """Returns when the client closes the connection (the request body read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(scheduler: Scheduler, api_key: str | None = None) -> Starlette:
    """The application over a started (or soon started) scheduler."""
    registry, tokenizer = scheduler.registry, scheduler.tokenizer
    positions = scheduler.model.config.max_position_embeddings
    vocab_size = scheduler.model.config.vocab_size
    created = int(time.time())

    def style_of(name: str):
        if name not in registry.styles:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves "
                                f"{', '.join(registry.names())} (see /v1/models)", "model", "model_not_found")
        return registry.styles[name]

    async def models(request: Request):
        return JSONResponse(model_list(registry.names(), created))

    async def model(request: Request):
        name = request.path_params["name"]
        style_of(name)
        return JSONResponse(model_card(name, created))

    async def generation(request: Request, chat: bool):
        req = (parse_chat if chat else parse_completion)(json_body(await request.body()))
        style = style_of(req.model)
        if chat:
            prompts = [chat_prompt_ids(tokenizer, req.messages, style)]
        else:
            prompts = [completion_prompt_ids(tokenizer, p, vocab_size, i) for i, p in enumerate(req.prompts)]
        default, param = (None, "messages") if chat else (COMPLETION_TOKENS, "prompt")
        budgets = [budget(len(p), req.max_tokens, positions, default, param) for p in prompts]
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emitter(index: int):
            def emit(event):
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:            # the server's loop is gone (shutting down)
                    pass
            return emit

        if len(prompts) > scheduler.max_queue:          # a 503 would never turn into an answer
            raise ApiError(400, f"{len(prompts)} prompts in one request, and this server queues at most "
                                f"{scheduler.max_queue} (--max-queue): send at most {scheduler.max_queue} per request",
                           "prompt", "too_many_prompts")
        jobs = [Job(req.model, p, b, req.temperature, req.top_k, req.top_p, req.seed, req.stop, emitter(i))
                for i, (p, b) in enumerate(zip(prompts, budgets))]
        try:
            scheduler.submit(jobs)
        except QueueFull:
            raise ApiError(503, f"the server is busy ({scheduler.max_queue} prompts waiting): retry later",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        reply = Reply(chat, req.model)
        if req.stream:
            return StreamingResponse(stream(jobs, events, reply, req.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole(request, jobs, events, reply)

    async def whole(request: Request, jobs: list, events: asyncio.Queue, reply: Reply):
        texts, reasons, tokens = [""] * len(jobs), [None] * len(jobs), [0, 0]
        left = asyncio.ensure_future(_disconnected(request))
        try:
            for _ in range(len(jobs)):
                while True:
                    got = asyncio.ensure_future(events.get())
                    await asyncio.wait({got, left}, return_when=asyncio.FIRST_COMPLETED)
                    if not got.done():          # the client left: nobody to answer
                        got.cancel()
                        return JSONResponse({})
                    index, event = got.result()
                    if event[0] == "text":
                        texts[index] += event[1]
                        continue
                    if event[0] == "error":
                        raise ApiError(event[1], event[2])
                    reasons[index] = event[1]
                    tokens[0] += event[2]
                    tokens[1] += event[3]
                    break
            return JSONResponse(reply.complete(list(zip(texts, reasons)), *tokens))
        finally:
            left.cancel()
            for job in jobs:
                scheduler.cancel(job)

    async def stream(jobs: list, events: asyncio.Queue, reply: Reply, include_usage: bool):
        tokens, pending = [0, 0], len(jobs)
        try:
            if reply.chat:
                yield sse(reply.chunk(0, role=True, with_usage=include_usage))
            while pending:
                index, event = await events.get()
                if event[0] == "text":
                    yield sse(reply.chunk(index, event[1], with_usage=include_usage))
                elif event[0] == "done":
                    pending -= 1
                    tokens[0] += event[2]
                    tokens[1] += event[3]
                    yield sse(reply.chunk(index, finish_reason=event[1], with_usage=include_usage))
                else:                           # the status line went out already: the error is the last event
                    yield sse(ApiError(event[1], event[2]).body())
                    return
            if include_usage:
                yield sse(reply.usage_chunk(*tokens))
            yield DONE
        finally:                                # also when the client left mid-stream (the task is cancelled)
            for job in jobs:
                scheduler.cancel(job)

    async def chat_completions(request: Request):
        return await generation(request, chat=True)

    async def completions(request: Request):
        return await generation(request, chat=False)

    routes = [Route("/v1/models", models), Route("/v1/models/{name:path}", model),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"])]
    return Starlette(routes=routes, middleware=[Middleware(ApiKeyCheck, key=api_key)] if api_key else [],
                     exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                         Exception: _internal_error})
