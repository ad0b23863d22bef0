"""The routes around generation: ``/health``, ``/version``, ``/metrics`` and ``/v1/models``."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from server.common import check_model
from server.state import ServerState


def add_admin_routes(app: FastAPI, state: ServerState, version: str) -> None:
    @app.get("/health")
    async def health():
        """200 when the engine serves; 503 while it loads, after it failed to load, or once it died."""
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, 503)
        if state.engine is None:
            return JSONResponse({"status": "loading"}, 503)
        if not state.engine.is_running:
            return JSONResponse({"status": "dead", "error": state.engine.dead_error}, 503)
        return {"status": "ok", "compile": state.engine.compile_state}

    @app.get("/version")
    async def get_version():
        """The version; once the model is loaded, also how it is served: the sampling defaults that
        requests' missing fields take (``--generation-config``), the reasoning parser and fields, whether the
        batch-invariant mode is in force (``--batch-invariant``) and the speculative proposers held."""
        if state.engine is None:
            return {"version": version}
        return {
            "version": version,
            "tensor_parallel_size": state.engine.tensor_parallel_size,
            "batch_invariant": state.engine.batch_invariant,
            # --speculative-method, and the proposers a request may pin (speculative.method)
            "speculative_method": state.engine.spec_method,
            "speculative_methods": list(state.engine.limits.spec_methods),
            "generation_config": state.settings.generation_config,
            "sampling_defaults": state.sampling_defaults,
            "reasoning_parser": state.settings.reasoning_parser,
            "reasoning_fields": list(state.settings.reasoning_fields),  # --reasoning-field
        }

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def cards() -> list[dict]:
        name = state.settings.served_model_name
        card = {"id": name, "object": "model", "created": state.created, "owned_by": "augur", "root": name}
        if state.engine is not None:
            card["max_model_len"] = state.engine.max_model_len
        # each LoRA adapter as vLLM lists one: its directory as root, the model it adapts as parent
        adapters = [
            {**card, "id": lora, "root": path, "parent": name} for lora, path in state.settings.lora_modules.items()
        ]
        return [card, *adapters]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": cards()}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        """One model's card (the SDK's ``models.retrieve``): the served model or an adapter, else a 404."""
        check_model(state, model)
        return next(c for c in cards() if c["id"] == model)
