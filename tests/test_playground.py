"""The playground (server/routes/playground.py): its files served from the package with no key (they
hold no data), everything it does through the API behind the key; off with --no-playground. The
page in a real browser: tests/test_playground_browser.py."""

from __future__ import annotations

import httpx
from test_ngram import target  # noqa: F401

from server.app import ServerSettings, create_app
from servers import engine_factory, serve


def test_the_page_and_its_files_are_served_and_the_api_keeps_its_key(target):  # noqa: F811
    settings = ServerSettings(served_model_name="m", api_key="k")
    with serve(create_app(settings, engine_factory(target))) as srv:
        root = httpx.get(srv.base + "/", follow_redirects=False)
        assert root.status_code in (302, 307) and root.headers["location"] == "/playground"
        page = httpx.get(srv.base + "/playground")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for asset, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
            assert f"/playground/{asset}" in page.text  # the page's own files, nothing from elsewhere
            r = httpx.get(f"{srv.base}/playground/{asset}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and r.content
        assert "http://" not in page.text and "https://" not in page.text
        assert httpx.get(srv.base + "/playground/nothing.js", headers={"Authorization": "Bearer k"}).status_code == 404
        assert httpx.get(srv.base + "/v1/models").status_code == 401  # the API still asks for the key
        assert httpx.get(srv.base + "/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    off = ServerSettings(served_model_name="m", playground=False)
    with serve(create_app(off, engine_factory(target))) as srv:
        assert httpx.get(srv.base + "/playground").status_code == 404
        assert httpx.get(srv.base + "/").status_code == 404
