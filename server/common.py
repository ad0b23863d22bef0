"""What every route shares: OpenAI-shaped errors, a body parsed into its request model, the model
name checked, the engine that must be ready, CPU work kept off the event loop."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from engine.core.async_engine import EngineFront
from server.protocol import BadBodyError, UnsupportedError, error_body, parse_json_body
from server.state import ServerState


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def ready_engine(state: ServerState) -> EngineFront:
    """The engine, or a 503 while it loads or after it died."""
    eng = state.engine
    if eng is None or not eng.is_running:
        raise APIError(
            503, "the model is not ready" if eng is None else "the engine is not running", "service_unavailable"
        )
    return eng


def check_model(state: ServerState, name: str | None) -> None:
    """A 404 unless ``name`` is the served model, one of its LoRA adapters, or left out."""
    if name is not None and name != state.settings.served_model_name and name not in state.settings.lora_modules:
        # (OpenAI's type for it: the request names what is not there)
        raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")


async def parse_request(request: Request, model):
    """The body as ``model`` (a pydantic request model), or a 400 that says what is wrong."""
    raw = await request.body()
    try:
        # A big body is parsed off the event loop, which keeps answering everyone else meanwhile.
        body = parse_json_body(raw) if len(raw) < 2**16 else await asyncio.to_thread(parse_json_body, raw)
    except BadBodyError as e:
        raise bad_request(str(e)) from None
    try:
        return model.model_validate(body)
    except UnsupportedError as e:
        raise bad_request(str(e), e.param) from None
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


async def off_loop(fn, size: int):
    """Run CPU work (tokenizing, rendering a chat template) on a worker thread when the input is
    big enough to hold the event loop up: /health and every stream keep being served meanwhile."""
    return fn() if size < 4096 else await asyncio.to_thread(fn)


def request_body(model) -> dict:
    """The OpenAPI request body of a handler that parses its JSON itself (off the event loop)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
