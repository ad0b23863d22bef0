"""The playground (``/playground``; ``/`` points to it; ``--no-playground`` turns both off): plain static
files of this package (server/playground/), no build step and nothing fetched from elsewhere.

The files hold no data and no secret, so they are served without the API key; everything the page
does goes through the API (``/v1/models``, ``/version``, ``/v1/completions``, ``/v1/chat/completions``),
with the key the user types into the page where the server asks for one.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import RedirectResponse, Response

FILES = {  # name → media type
    "index.html": "text/html; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}
ROOT = Path(__file__).resolve().parent.parent / "playground"
OPEN_PATHS = {"/", "/playground", *(f"/playground/{name}" for name in FILES)}  # (no key: see the module)


def add_playground_routes(app: FastAPI) -> None:
    contents = {name: (ROOT / name).read_bytes() for name in FILES}

    @app.get("/", include_in_schema=False)
    async def root():
        return RedirectResponse("/playground")

    @app.get("/playground", include_in_schema=False)
    async def page():
        return Response(contents["index.html"], media_type=FILES["index.html"])

    @app.get("/playground/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in contents:
            raise HTTPException(404)
        return Response(contents[name], media_type=FILES[name], headers={"Cache-Control": "no-cache"})
