"""The HTTP application (starlette): /v1/models, /v1/chat/completions and /v1/completions over a Scheduler,
streamed as server-sent events or answered whole (n choices per prompt, logprobs, echo), /health and /metrics;
the API key checked on /v1; every refusal an OpenAI error object with its 4xx status, and a bug a 500 without
its traceback, the server serving on."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from wgpu_train.serve.api_error import ApiError
from wgpu_train.serve.images import request_images, request_pixels
from wgpu_train.serve.prompts import (COMPLETION_TOKENS, budget, chat_prompt_ids, completion_prompt_ids,
                                      image_chat_prompt_ids, tool_prompt)
from wgpu_train.serve.requests import json_body, parse_chat, parse_completion
from wgpu_train.serve.tool_calls import live_content, openai_message, plan_tools
from wgpu_train.engines.generate import Sampling
from wgpu_train.serve.metrics import CONTENT_TYPE as METRICS_TYPE
from wgpu_train.serve.responses import DONE, Logprobs, Reply, model_card, model_list, sse
from wgpu_train.serve.scheduler import Job, QueueFull, Scheduler

log = logging.getLogger("wgpu_train.serve")
OPEN_PATHS = ("/health", "/metrics")         # served without the API key
RETRY_AFTER_S = 1               # what a 503 (the queue is full) asks the client to wait


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class ApiKeyCheck:
    """ASGI middleware: every HTTP request but /health and /metrics must carry `Authorization: Bearer <key>`,
    else a 401."""

    def __init__(self, app, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
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


def build_app(scheduler: Scheduler, api_key: str | None = None, allow_remote_images: bool = False) -> Starlette:
    """The application over a started (or soon started) scheduler. The API key guards /v1; /health and
    /metrics answer without it, as vLLM's do (for load balancers and Prometheus). allow_remote_images: chat
    images may be http(s) URLs, fetched (else only data: and file:// ones)."""
    registry, tokenizer = scheduler.registry, scheduler.tokenizer
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

    async def health(request: Request):
        if scheduler.alive():
            return JSONResponse({"status": "ok"})
        return error_response(ApiError(503, "the worker is not running", code="unavailable"))

    async def metrics(request: Request):
        return Response(scheduler.metrics.render(), media_type=METRICS_TYPE)

    async def generation(request: Request, chat: bool):
        req = (parse_chat if chat else parse_completion)(json_body(await request.body()))
        style = style_of(req.model)
        plan, pixels = None, None
        if chat and req.images:
            if scheduler.vision is None:
                raise ApiError(400, f"the model '{req.model}' takes no images (a text-only model)", "messages",
                               "images_not_supported")
            images = request_images(req.images, allow_remote_images)
            pixels = request_pixels(images, scheduler.vision)
            if req.tools is not None:       # the tools rendered, then the images' placeholders expanded
                plan = plan_tools(tokenizer, req.tools, tool_prompt(tokenizer, req.messages, style, req.tools.tools))
            prompts = [image_chat_prompt_ids(tokenizer, scheduler.vision, req.messages, style, images, plan)]
        elif chat and req.tools is not None:
            plan = plan_tools(tokenizer, req.tools, tool_prompt(tokenizer, req.messages, style, req.tools.tools))
            prompts = [tokenizer.encode(plan.prompt + plan.prefill)]
        elif chat:
            prompts = [chat_prompt_ids(tokenizer, req.messages, style)]
        else:
            prompts = [completion_prompt_ids(tokenizer, p, vocab_size, i) for i, p in enumerate(req.prompts)]
        default, param = (None, "messages") if chat else (COMPLETION_TOKENS, "prompt")
        budgets = [budget(len(p), req.max_tokens, scheduler.context, default, param) for p in prompts]
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emitter(index: int):
            def emit(event):
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:            # the server's loop is gone (shutting down)
                    pass
            return emit

        answers = len(prompts) * req.n
        if answers > scheduler.max_queue:          # a 503 would never turn into an answer
            raise ApiError(400, f"{answers} answers in one request ({len(prompts)} prompts, n {req.n}), and this "
                                f"server queues at most {scheduler.max_queue} (--max-queue): ask at most "
                                f"{scheduler.max_queue} per request", "n" if req.n > 1 else "prompt",
                           "too_many_prompts")
        jobs = []
        for p, b in zip(prompts, budgets):
            for j in range(req.n):      # choice j of a seeded request draws from seed + j
                seed = None if req.seed is None else (req.seed + j) & 0xFFFFFFFFFFFFFFFF
                sampling = Sampling(req.temperature, req.top_k, req.top_p, seed, req.presence_penalty,
                                    req.frequency_penalty)
                jobs.append(Job(req.model, p, b, sampling, req.stop, emitter(len(jobs)), req.logprobs, req.echo,
                                special_tokens=plan is not None and plan.parse, images=pixels))
        try:
            scheduler.submit(jobs)
        except QueueFull:
            raise ApiError(503, f"the server is busy ({scheduler.max_queue} answers waiting): retry later",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        echoes = [_echo_text(tokenizer, p, ids) if req.echo else "" for p, ids in
                  zip(req.prompts or [None], prompts) for _ in range(req.n)]
        answer = _Answer(Reply(chat, req.model), Logprobs(tokenizer, chat), req.n, echoes, req.logprobs is not None,
                         plan if plan is not None and plan.parse else None)
        if req.stream:
            return StreamingResponse(stream(jobs, events, answer, req.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole(request, jobs, events, answer)

    async def whole(request: Request, jobs: list, events: asyncio.Queue, answer: _Answer):
        left = asyncio.ensure_future(_disconnected(request))
        try:
            for index in range(len(jobs)):
                if answer.echoes[index] and not answer.logprobs:
                    answer.take(index, ("echo",))
            pending = len(jobs)
            while pending:
                got = asyncio.ensure_future(events.get())
                await asyncio.wait({got, left}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():          # the client left: nobody to answer
                    got.cancel()
                    return JSONResponse({})
                index, event = got.result()
                if event[0] == "error":
                    raise ApiError(event[1], event[2])
                answer.take(index, event)
                pending -= event[0] == "done"
            return JSONResponse(answer.reply.complete(answer.whole(), *answer.tokens))
        finally:
            left.cancel()
            for job in jobs:
                scheduler.cancel(job)

    async def stream(jobs: list, events: asyncio.Queue, answer: _Answer, include_usage: bool):
        reply, pending = answer.reply, len(jobs)
        try:
            for index in range(len(jobs)):
                if reply.chat:
                    yield sse(reply.chunk(index, role=True, with_usage=include_usage))
                elif answer.echoes[index] and not answer.logprobs:
                    yield sse(reply.chunk(index, answer.take(index, ("echo",)), with_usage=include_usage))
            while pending:
                index, event = await events.get()
                if event[0] == "error":          # the status line went out already: the error is the last event
                    yield sse(ApiError(event[1], event[2]).body())
                    return
                text, logprobs = answer.take(index, event)
                if event[0] == "done":
                    pending -= 1
                    if answer.plan is not None:     # the content held back, then the calls
                        message, _ = answer.message(index)
                        for chunk in reply.tool_call_chunks(index, message, answer.sent[index], include_usage):
                            yield sse(chunk)
                    yield sse(reply.chunk(index, finish_reason=answer.reasons[index], with_usage=include_usage))
                elif answer.plan is not None:
                    if piece := answer.live(index):
                        yield sse(reply.chunk(index, piece, with_usage=include_usage))
                elif text or logprobs:
                    yield sse(reply.chunk(index, text, with_usage=include_usage, logprobs=logprobs))
            if include_usage:
                yield sse(reply.usage_chunk(*answer.tokens))
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
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/health", health), Route("/metrics", metrics)]
    return Starlette(routes=routes, middleware=[Middleware(ApiKeyCheck, key=api_key)] if api_key else [],
                     exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                         Exception: _internal_error})


def _echo_text(tokenizer, given, ids: list) -> str:
    """The prompt as echo gives it back: its text as sent, or token ids decoded."""
    return given if isinstance(given, str) else tokenizer.decode(ids, skip_special_tokens=False)


class _Answer:
    """One request's choices as their events come: text, finish reasons, logprobs objects, usage."""

    def __init__(self, reply: Reply, shape: Logprobs, n: int, echoes: list, logprobs: bool, plan=None):
        self.reply, self.shape, self.n, self.echoes, self.logprobs = reply, shape, n, echoes, logprobs
        self.plan = plan                # a ToolPlan: each choice's text is parsed into a message with tool calls
        self.sent = [""] * len(echoes)  # with a plan: the content streamed so far
        self.stops = set(shape.tokenizer.stop_token_ids)
        self.texts = [""] * len(echoes)
        self.reasons = [None] * len(echoes)
        self.objects = [shape.empty() if logprobs else None for _ in echoes]
        self.tokens = [0, 0]            # usage: prompt tokens (once per prompt, whatever n), completion tokens

    def take(self, index: int, event: tuple) -> tuple:
        """Record a worker event of choice `index` (or ("echo",)); the (text, logprobs object) it adds."""
        kind, at = event[0], len(self.texts[index])
        if kind == "echo":
            text, entries = self.echoes[index], None
        elif kind == "prompt":      # echo with logprobs: the prompt's tokens, the first without a logprob
            text, entries = self.echoes[index], [(event[1], None, None)] + event[2]
        elif kind == "text":        # chat's logprobs leave out a stop token, whose text is no part of the answer
            text, entries = event[1], event[2]
            if entries and self.reply.chat:
                entries = [e for e in entries if e[0] not in self.stops]
        else:                           # done: (finish_reason, prompt tokens, completion tokens)
            self.reasons[index] = event[1]
            self.tokens[0] += event[2] if index % self.n == 0 else 0
            self.tokens[1] += event[3]
            return "", None
        self.texts[index] += text
        if entries is None:
            return text, None
        self.shape.extend(self.objects[index], entries, at)
        return text, self.shape.of(entries, at)

    def live(self, index: int) -> str:
        """With a plan, the content of choice `index` that may be streamed now and was not yet."""
        content = live_content(self.plan, self.texts[index])
        if not content.startswith(self.sent[index]) or content == self.sent[index]:
            return ""
        piece, self.sent[index] = content[len(self.sent[index]):], content
        return piece

    def message(self, index: int) -> tuple[dict, str]:
        """Choice `index`'s message, its tool calls parsed, and its finish reason ("tool_calls" when it has some)."""
        message, calls = openai_message(self.shape.tokenizer, self.plan, self.texts[index])
        if calls:
            self.reasons[index] = "tool_calls"
        return message, self.reasons[index]

    def whole(self) -> list:
        """(text or message, finish_reason, logprobs object) of every choice."""
        if self.plan is not None:
            return [(*self.message(i), lp) for i, lp in enumerate(self.objects)]
        return list(zip(self.texts, self.reasons, self.objects))
