"""Loading and unloading LoRA adapters while serving (``--enable-runtime-lora``), in vLLM's shapes:
``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter``
``{"lora_name"}``. Behind the API key like every other route; absent (404) unless enabled.

A loaded adapter is served by its name at once and listed by ``/v1/models``; an unloaded one is a
404 for new requests at once, while its running requests finish under it (engine/lora/registry.py).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from server.common import APIError, bad_request, parse_request, ready_engine, request_body
from server.state import ServerState


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1)


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    adapters = state.settings.lora_modules  # name → directory: what check_model and /v1/models read

    @app.post("/v1/load_lora_adapter", openapi_extra=request_body(LoadLoraRequest))
    async def load_lora_adapter(request: Request):
        req: LoadLoraRequest = await parse_request(request, LoadLoraRequest)
        if req.lora_name == state.settings.served_model_name:
            raise bad_request(f"{req.lora_name!r} is the served model's name", "lora_name")
        try:
            await ready_engine(state).lora("load", req.lora_name, req.lora_path)
        except ValueError as e:  # AdapterError: the message says why
            raise bad_request(str(e), "lora_path") from None
        adapters[req.lora_name] = req.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=request_body(UnloadLoraRequest))
    async def unload_lora_adapter(request: Request):
        req: UnloadLoraRequest = await parse_request(request, UnloadLoraRequest)
        eng = ready_engine(state)
        path = adapters.pop(req.lora_name, None)  # new requests naming it are 404s from now
        try:
            await eng.lora("unload", req.lora_name)
        except KeyError:
            if path is not None:  # (not the engine's: a start-up race at most) served as before
                adapters[req.lora_name] = path
            raise APIError(
                404, f"The lora adapter '{req.lora_name}' cannot be found.", "not_found_error", "lora_name"
            ) from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
