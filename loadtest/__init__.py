"""Load generator for OpenAI-compatible servers: ``python -m loadtest --help``.

Streams chat or completion requests at a fixed concurrency (closed loop) or a Poisson rate (open
loop) and reports TTFT, TPOT, ITL, E2E percentiles, throughput, goodput under SLOs, errors by kind
and speculative decoding's mean acceptance length, optionally with and without speculation.
"""
