"""The OpenAI-compatible HTTP front: the app factory.

It loads the engine off the event loop (``/health`` answers 503 meanwhile), maps every error to
OpenAI's error shape, puts auth and the body limits in front, and mounts the routes:
``routes/completions.py`` and ``routes/chat.py`` (generation, relayed by ``relay.py``),
``routes/responses.py`` (the Responses API, on chat's path), ``routes/tokenize.py`` and
``routes/admin.py``. Nothing here touches a tensor; the routes reach the
engine only through a front (:class:`~engine.core.async_engine.EngineFront`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.async_engine import EngineFront
from server.common import APIError
from server.limits import BodyLimits
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    TokenizeRequest,
    UnsupportedError,
    error_body,
)
from server.responses.protocol import ResponsesRequest
from server.routes.admin import add_admin_routes
from server.routes.chat import add_chat_routes
from server.routes.completions import add_completion_routes
from server.routes.lora import add_lora_routes
from server.routes.playground import OPEN_PATHS, add_playground_routes
from server.routes.responses import add_response_routes
from server.routes.tokenize import add_tokenizer_routes
from server.state import API_KEY_SCOPE, ServerSettings, ServerState

logger = logging.getLogger(__name__)

try:
    AUGUR_VERSION = version("augur")
except PackageNotFoundError:  # running from a source tree that was not installed
    AUGUR_VERSION = "0.0.0+local"


class BearerAuth:
    """Require ``Authorization: Bearer KEY`` (one of the keys, compared in constant time) except on
    open paths; the scope's :data:`API_KEY_SCOPE` names the key a request came with (a digest), for
    what belongs to one key (stored responses).

    A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware
    wraps ``receive`` so that ``Request.is_disconnected()`` never sees the client leave, and a
    non-streaming request would then run to completion for nobody."""

    def __init__(self, app, keys: list[str], open_paths: set[str]) -> None:
        self.app, self.keys, self.open_paths = app, [k.encode() for k in keys], open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            matched = [hmac.compare_digest(token, k) for k in self.keys]  # every key compared: no early exit
            if not any(matched):
                body = error_body("invalid or missing API key", "authentication_error", code="invalid_api_key")
                await JSONResponse(body, 401)(scope, receive, send)
                return
            scope[API_KEY_SCOPE] = hashlib.sha256(token).hexdigest()
        await self.app(scope, receive, send)


def create_app(
    settings: ServerSettings,
    engine_factory: Callable[[], EngineFront],
    on_load_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    """The app. ``engine_factory`` runs on a background thread at start-up, so /health can answer
    503 while the model loads. If it fails, /health reports why, and ``on_load_failure(reason)`` is
    called: ``augur serve`` then stops the server and exits non-zero, so that Docker, Kubernetes or
    ``make serve`` see the failure (and restart with the reason logged) instead of a server that
    answers 503 forever."""
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        def load() -> None:
            try:
                state.attach(engine_factory())
                logger.info("engine ready: serving %s", settings.served_model_name)
            except Exception as e:
                logger.exception("engine failed to load")
                state.load_error = f"{type(e).__name__}: {e}"
                if on_load_failure is not None:
                    on_load_failure(state.load_error)

        threading.Thread(target=load, name="augur-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.shutdown()

    # No redirect_slashes: `POST /v1/completions/` is a 404 in OpenAI's shape, not an empty 307.
    app = FastAPI(title="Augur", version=AUGUR_VERSION, lifespan=lifespan, redirect_slashes=False)
    app.state.augur = state
    add_error_handlers(app, state)
    # Limits and auth (the last added runs first: auth, then the body limits).
    app.add_middleware(BodyLimits, max_bytes=settings.max_request_bytes, timeout_s=settings.body_timeout_s)
    if settings.api_keys:
        open_paths = {"/health", "/metrics"} | (OPEN_PATHS if settings.playground else set())
        app.add_middleware(BearerAuth, keys=settings.api_keys, open_paths=open_paths)
    add_admin_routes(app, state, AUGUR_VERSION)
    add_completion_routes(app, state)
    add_chat_routes(app, state)
    add_response_routes(app, state)
    add_tokenizer_routes(app, state)
    if settings.enable_runtime_lora:
        add_lora_routes(app, state)
    if settings.playground:
        add_playground_routes(app)
    models = [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest]
    publish_request_schemas(app, models)
    return app


def add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", []
        ctx_err = (first.get("ctx") or {}).get("error")
        if isinstance(ctx_err, UnsupportedError | FieldError):  # they name their field themselves
            return JSONResponse(error_body(str(ctx_err), "invalid_request_error", ctx_err.param), 400)
        param = ".".join(loc) or None
        return JSONResponse(error_body(f"{param + ': ' if param else ''}{msg}", "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), exc.status_code, headers=exc.headers)  # (a 405's Allow)

    @app.exception_handler(Exception)
    async def _internal(_req, exc: Exception):
        logger.exception("unhandled error")
        state.metrics.request_failure.labels(**state.metrics.labels, reason="internal").inc()
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), 500)


def publish_request_schemas(app: FastAPI, models: list) -> None:
    """Put the pydantic request models (and the models they nest) into /openapi.json's components,
    where :func:`~server.common.request_body` points: generated clients and fuzzers see the real schema."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
