"""Real servers for the tests: the app under uvicorn (with the production limits) on a loopback port."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import LLMEngine
from server.limits import uvicorn_config

NUM_BLOCKS = 1024
MAX_LEN = 512


# -- servers --------------------------------------------------------------------------------------------
@dataclass
class Served:
    app: FastAPI
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def async_engine(self) -> AsyncEngine:
        return self.app.state.augur.engine

    @property
    def engine(self) -> LLMEngine:
        return self.async_engine.engine


def engine_factory(model_dir, **kw) -> Callable[[], AsyncEngine]:
    """An engine on ``model_dir`` (CPU, float32, a pool of NUM_BLOCKS blocks of 4, MAX_LEN context);
    ``kw`` sets any other EngineConfig field or overrides these. ``AUGUR_TEST_FRONT=process`` puts the
    engine in a process of its own (``--engine-process on``) for every server test built on this."""
    defaults = dict(device="cpu", dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=4, max_model_len=MAX_LEN)

    def make() -> AsyncEngine:
        config = EngineConfig(model=str(model_dir), **{**defaults, **kw})
        if os.environ.get("AUGUR_TEST_FRONT") == "process":  # the server tests against an engine process
            from engine.core.engine_core import ProcessEngine

            return ProcessEngine(config)
        return AsyncEngine(LLMEngine(config))

    return make


# How long a test waits for an engine to load: a first start in a clean environment builds the C++
# kernels (about a minute on two cores), whichever test comes first. A bound on a hang, no timing claim.
FIRST_LOAD_S = 600.0


def wait_until(ok: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``ok`` until it holds; the bound only turns a hang into a failure, it is no timing claim."""
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@contextmanager
def serve(app: FastAPI, wait_ready: bool = True, **limits) -> Iterator[Served]:
    """Run ``app`` under uvicorn on a free loopback port, in a thread of this process."""
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, "warning", **limits))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
    assert server.started, "uvicorn failed to start"
    served = Served(app, server.servers[0].sockets[0].getsockname()[1])
    try:
        if wait_ready:
            wait_until(lambda: httpx.get(served.base + "/health").status_code == 200, "/health to answer 200",
                       FIRST_LOAD_S)  # fmt: skip
        yield served
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive(), "uvicorn did not shut down"


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes (other than this one) that contain ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args and cmdline.parent.name != str(os.getpid()):
            found.append(args)
    return found
