"""The front door's HTTP service: a Starlette app whose requests become `Router.Generate` calls.

`build_app` serves
- ``GET /v1/models``: the one served model;
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: parsed by `openai_api`, sent to
  the router over grpc.aio, answered whole or streamed as server-sent events (``data: {json}``
  per chunk, a usage chunk with ``stream_options.include_usage``, then ``data: [DONE]``);
- ``GET /health``: 200 once the app runs;
- ``GET /metrics``: Prometheus text, the front door's request counters then the router's
  exposition (`metrics.FrontDoorMetrics`).

Text goes in and out through the served model's tokenizer (engine/tokenizer.py: a checkpoint's own,
or the byte-level one of the presets) and streams through `text.TextStream`. A stop string or the
tokenizer's end-of-sequence id (unless ``ignore_eos``) ends the reply (``finish_reason`` "stop";
the end-of-sequence token is counted, not shown) and cancels the router call, which frees the
decode slot; otherwise the reply runs to the budget ("length"). A client that disconnects
mid-stream cancels the call as well. Several prompts, ``n``, ``best_of``, ``echo`` and
log-probabilities not streamed are answered whole: one router call per prompt and choice, all at
once (an ``x-request-id`` gets the call's index as a suffix), their replies read by `reply.Reply`
and shaped by `reply.whole_choices`.

Errors keep OpenAI's shape. Refusals of the front door itself: 400 (`openai_api`; 404
``model_not_found`` for another model), 401 without the bearer token of ``token`` (compared in
constant time), 404 for another path, 413 for a body larger than any valid request. Refusals of
the router map by gRPC status: INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED 429 (admission),
ALREADY_EXISTS 409 (an ``x-request-id`` already in flight), UNAVAILABLE 503 (no live instance),
DEADLINE_EXCEEDED 504, anything else 500. Before the first token the client gets that status;
after it (the SSE response already sent 200) an ``error`` event and the end of the stream.

`FrontDoorServer` runs the app on uvicorn in a thread, on a socket it binds first (so port 0
works and the address is known before it starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prfaas_jax.engine.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from prfaas_jax.errors import UserError
from prfaas_jax.serving.cluster_config import ClusterConfig, serving_model_config
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.frontdoor.metrics import CONTENT_TYPE, FrontDoorMetrics
from prfaas_jax.serving.frontdoor.openai_api import (
    ApiError,
    Completion,
    models,
    parse_completion,
    response,
)
from prfaas_jax.serving.frontdoor.reply import ENDED_EARLY, Reply, router_error, whole_choices
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.messages import check_request_id, router_max_request_bytes
from prfaas_jax.serving.transport.security import (
    bearer_matches,
    channel_credentials,
    check_listen,
    client_metadata,
    http_client_context,
    http_ssl_context,
    read_token,
)


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body, status_code=err.status)


class FrontDoor:
    """The app's state: the router channel (made on the server's event loop), the model and its
    tokenizer (default: the byte-level one), and its metrics (with the router's Prometheus
    endpoint, host:port, when it is known)."""

    def __init__(
        self,
        router: str,
        *,
        model: str,
        vocab_size: int,
        max_len: int,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float = 600.0,
        tokenizer: Tokenizer | None = None,
        router_metrics: str | None = None,
        router_metrics_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.router, self.model, self.vocab_size, self.max_len = router, model, vocab_size, max_len
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.token, self.credentials, self.timeout_s = token, credentials, timeout_s
        self.created = int(time.time())
        self.metrics = FrontDoorMetrics(router_metrics, tls=router_metrics_tls, token=token)
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.RouterStub | None = None

    @property
    def stub(self) -> pb_grpc.RouterStub:
        if self._stub is None:  # grpc.aio binds a channel to the running loop
            options = [("grpc.max_send_message_length", router_max_request_bytes(self.max_len))]
            self._channel = (
                grpc.aio.insecure_channel(self.router, options=options)
                if self.credentials is None
                else grpc.aio.secure_channel(self.router, self.credentials, options=options)
            )
            self._stub = pb_grpc.RouterStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    def authorized(self, request: Request) -> bool:
        return bearer_matches(request.headers.get("authorization"), self.token)

    # --- endpoints ----------------------------------------------------------------------------

    async def list_models(self, request: Request) -> Response:
        if not self.authorized(request):
            return _error(UNAUTHORIZED)
        return JSONResponse(models(self.model, self.created))

    async def completions(self, request: Request) -> Response:
        return self._counted(request, await self._complete(request, chat=False))

    async def chat_completions(self, request: Request) -> Response:
        return self._counted(request, await self._complete(request, chat=True))

    def _counted(self, request: Request, response: Response) -> Response:
        self.metrics.count(request.url.path, response.status_code)
        return response

    async def prometheus(self, request: Request) -> Response:
        if not self.authorized(request):
            return _error(UNAUTHORIZED)
        return Response(await self.metrics.render(), media_type=CONTENT_TYPE)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _body(self, request: Request) -> bytes:
        """The body, refused (413) past what a valid request can hold: every token of a full
        context as a JSON number or 4 escaped bytes of text, and 64 KiB for the rest."""
        limit = 16 * self.max_len + 65536
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise ApiError(413, f"the request body is over {limit:,} bytes")
        return bytes(body)

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        if not self.authorized(request):
            return _error(UNAUTHORIZED)
        try:
            try:
                body = json.loads(await self._body(request))
            except (ValueError, UnicodeDecodeError):
                raise ApiError(400, "the request body is not valid JSON") from None
            completion = parse_completion(
                body,
                chat=chat,
                model=self.model,
                vocab_size=self.vocab_size,
                max_len=self.max_len,
                tokenizer=self.tokenizer,
            )
            request_id = request.headers.get("x-request-id", "")
            try:
                check_request_id(request_id)
            except UserError as err:
                raise ApiError(400, f"x-request-id: {err}", param="x-request-id") from None
            rid = ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex)
            if completion.whole_only and not completion.stream:
                return JSONResponse(await self._whole(completion, rid, request_id))
            reply = await self._open(
                completion, rid, completion.prompt_ids, completion.sampling.seed, request_id
            )
        except ApiError as err:
            return _error(err)
        if completion.stream:
            headers = {"x-request-id": rid}
            return StreamingResponse(
                reply.events(), media_type="text/event-stream", headers=headers
            )
        try:
            return JSONResponse(await reply.whole())
        except ApiError as err:
            return _error(err)

    async def _open(
        self, completion: Completion, rid: str, prompt: list[int], seed: int, request_id: str
    ) -> Reply:
        """The router call of one prompt and seed, once its first message came (the status of
        a refusal reaches the client before any 200)."""
        scored = completion.logprobs is not None or completion.best_of > completion.n
        call = self.stub.Generate(
            pb.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                max_new_tokens=completion.max_tokens,
                temperature=completion.sampling.temperature,
                top_p=completion.sampling.top_p,
                top_k=completion.sampling.top_k,
                seed=seed,
                logprobs=(completion.logprobs or 0) if scored else None,
                prompt_logprobs=completion.echo and completion.logprobs is not None,
            ),
            timeout=self.timeout_s,
            metadata=client_metadata(self.token),
        )
        messages = aiter(call)
        try:
            first = await anext(messages)
        except grpc.aio.AioRpcError as err:
            raise router_error(err) from None
        except StopAsyncIteration:
            raise ENDED_EARLY from None
        except asyncio.CancelledError:  # the client went away while it waited
            call.cancel()
            raise
        return Reply(completion, rid, self.model, call, first, messages, self.tokenizer, prompt)

    async def _whole(self, completion: Completion, rid: str, request_id: str) -> dict:
        """Every prompt's ``best_of`` choices, asked of the router at once, answered whole."""

        async def one(index: int, prompt: list[int], seed: int) -> tuple[Reply, str, str]:
            wire_id = f"{request_id}.{index}" if request_id else ""
            reply = await self._open(completion, rid, prompt, seed, wire_id)
            return (reply, *await reply.collect())

        calls = [
            (list(prompt), seed) for prompt in completion.prompts for seed in completion.seeds()
        ]
        tasks = [asyncio.ensure_future(one(i, *call)) for i, call in enumerate(calls)]
        try:
            finished = await asyncio.gather(*tasks)
        finally:  # one refused or failed: the others stop too
            for task in tasks:
                task.cancel()
        firsts = finished[:: completion.best_of]  # a prompt counts once, whatever its choices
        counts = (
            sum(len(p) for p in completion.prompts),
            sum(reply.tokens for reply, _, _ in finished),
            sum(reply.cached for reply, _, _ in firsts),
        )
        choices = whole_choices(completion, self.tokenizer, finished)
        return response(completion, rid, self.model, choices, counts)


UNAUTHORIZED = ApiError(
    401, "missing or invalid bearer token", kind="authentication_error", code="invalid_api_key"
)


def build_app(door: FrontDoor) -> Starlette:
    routes = [
        Route("/v1/models", door.list_models, methods=["GET"]),
        Route("/v1/completions", door.completions, methods=["POST"]),
        Route("/v1/chat/completions", door.chat_completions, methods=["POST"]),
        Route("/health", door.health, methods=["GET"]),
        Route("/metrics", door.prometheus, methods=["GET"]),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        message = f"{request.method} {request.url.path}: " + (
            "no such endpoint" if status == 404 else "method not allowed"
        )
        return _error(ApiError(status, message))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await door.close()

    return Starlette(
        routes=routes, exception_handlers={404: not_found, 405: not_found}, lifespan=lifespan
    )


class FrontDoorServer:
    """`build_app(door)` on uvicorn in a daemon thread, listening on ``host:port`` (0: any free
    port) from construction; `address` is ``host:port``; `stop` shuts it down. With
    `security` certificates it serves HTTPS (`http_ssl_context`: the door's bearer token, or
    without one a CA-signed client certificate); beyond loopback it needs them unless
    `allow_plaintext` (`check_listen`)."""

    def __init__(
        self,
        door: FrontDoor,
        host: str = "127.0.0.1",
        port: int = 0,
        security: SecuritySection | None = None,
    ) -> None:
        context = http_ssl_context(security)
        check_listen(security, host, "the OpenAI front door", tls=context is not None)
        try:
            self._socket = socket.create_server((host, port))
        except OSError as err:
            raise UserError(f"the HTTP front door cannot listen on {host}:{port}: {err}") from None
        self.address = "{}:{}".format(*self._socket.getsockname()[:2])
        scheme = "http" if context is None else "https"
        self.base_url = f"{scheme}://{self.address}/v1"
        config = uvicorn.Config(build_app(door), log_level="warning", lifespan="on")
        config.load()
        config.ssl = context  # the project's context, not one uvicorn builds from file names
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> FrontDoorServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP front door did not start")
            time.sleep(0.01)
        return self

    def wait(self) -> None:
        self._thread.join()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()

    def __enter__(self) -> FrontDoorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cluster_front_door(
    config: ClusterConfig,
    router: str,
    host: str = "127.0.0.1",
    port: int = 0,
    router_metrics: str | None = None,
) -> FrontDoorServer:
    """The front door of a cluster whose router is at `router` (its Prometheus endpoint at
    `router_metrics`), as `prfaas serve --openai-port` runs it: the config's model, its tokenizer
    and max_len, and its `[security]` (TLS to the router with the node certificate; the bearer
    token required of clients and passed on)."""
    cfg = serving_model_config(config)
    door = FrontDoor(
        router,
        model=config.model.preset,
        vocab_size=cfg.vocab_size,
        max_len=cfg.max_len,
        token=read_token(config.security),
        credentials=channel_credentials(config.security),
        tokenizer=load_tokenizer(config.model.preset, cfg.vocab_size),
        router_metrics=router_metrics,
        router_metrics_tls=http_client_context(config.security),
    )
    return FrontDoorServer(door, host, port, config.security)
