"""The ``augur`` executable: settings that must come before torch is imported, then the command line.

OpenMP (torch's CPU thread pool) reads its environment once, when torch loads it: the thread count and
wait policy of :func:`engine.platform.openmp_defaults` are put in the environment here, where the user
set none, before :mod:`server.cli` imports torch.
"""

from __future__ import annotations

import os


def main() -> int:
    from engine.platform import openmp_defaults  # imports no torch

    for key, value in openmp_defaults().items():
        os.environ.setdefault(key, value)
    from server.cli import main as cli_main

    return cli_main()
