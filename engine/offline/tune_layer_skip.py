"""``augur tune-layer-skip``: which sublayers should the layer-skip draft leave out?

The search space is one yes/no per sublayer — the attention and the MLP of each of the ``L`` layers,
``2L`` binary choices — and the objective is what serving cares about: the measured tokens/s of the
whole speculative step (drafting, verification, early stopping, bookkeeping) on the given prompts.
Skipping more makes each draft level cheaper and its tokens less often accepted; no proxy (a
distance between hidden states, an acceptance rate alone) weighs the two the way the clock does.

Each trial points the engine's layer-skip proposer at a candidate skip set, warms it up on one
prompt, and times all prompts at a fixed draft depth (``--num-speculative-tokens``; the controller's
cost model was profiled for one skip set and would mislead the comparison). The three fastest skip
sets are then timed twice more and the best median wins (the fastest of many noisy timings is partly
luck). Plain decoding is timed before and after, in the same process, for the ratio.

The optimiser is optuna's Gaussian-process sampler (``optuna.samplers.GPSampler``): Bayesian
optimisation suits an objective that costs seconds per evaluation and is noisy, it handles integer
(here 0/1) parameters natively, ``enqueue_trial`` starts it from informed guesses (nothing skipped,
the middle-half default, attention-only and MLP-only variants), and optuna is maintained and
installs from wheels. scikit-optimize is no longer maintained, and bayesian-optimization searches
continuous boxes only.

Tuning runs the target eagerly by default (``--compile auto`` means off here): each skip set would
otherwise compile its own graph. The skip set found serves compiled like any other.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.models.layer_skip import LayerSkip
from engine.offline.measure import run_augur
from engine.request.sampling_params import SamplingParams
from engine.speculative.early_stop import EarlyStop

logger = logging.getLogger(__name__)


@dataclass
class Trial:
    skip: LayerSkip
    tokens_per_s: float
    mean_acceptance_length: float  # tokens per verify step (1.0: nothing accepted)


@dataclass
class TuneResult:
    best: Trial
    trials: list[Trial]
    plain_tokens_per_s: float  # the mean of the plain runs before and after the search
    depth: int

    def to_dict(self, model: str) -> dict:
        """The JSON ``--layer-skip-config`` loads (it reads ``attention`` and ``mlp``; the rest documents)."""
        return {
            **self.best.skip.to_dict(),
            "tuned": {
                "model": model,
                "tokens_per_s": round(self.best.tokens_per_s, 2),
                "plain_tokens_per_s": round(self.plain_tokens_per_s, 2),
                "speedup": round(self.best.tokens_per_s / self.plain_tokens_per_s, 3),
                "mean_acceptance_length": round(self.best.mean_acceptance_length, 3),
                "draft_depth": self.depth,
                "trials": len(self.trials),
                "sampler": "optuna GPSampler",
            },
        }


def starting_points(num_layers: int) -> list[LayerSkip]:
    """Informed first trials: nothing skipped (the target drafting for itself: every token accepted,
    no time saved), the middle half both ways, attention only and MLP only."""
    mid = LayerSkip.middle(num_layers)
    out = [LayerSkip(), mid, LayerSkip(attn=mid.attn), LayerSkip(mlp=mid.mlp)]
    odd = frozenset(range(1, num_layers - 1, 2))
    out.append(LayerSkip(odd, odd))
    return list(dict.fromkeys(out))  # few layers: some coincide


def measure(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> Trial:
    """Tokens/s and tokens per verify step of the engine's current skip set on the prompts."""
    proposer = engine.proposer
    if proposer.early_stop is not None:  # every candidate starts from the same threshold
        proposer.early_stop = EarlyStop(proposer.early_stop.target)
    warm = min(params.max_tokens, 8)
    run_augur(engine, prompts[:1], warm, 1, dataclasses.replace(params, max_tokens=warm))
    r = run_augur(engine, prompts, params.max_tokens, concurrency, params)
    return Trial(proposer.skip, r.tokens_per_s, r.mean_acceptance_length)


def tune_layer_skip(
    config: EngineConfig,
    prompts: list[list[int]],
    *,
    trials: int = 40,
    max_tokens: int = 64,
    concurrency: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    on_trial: Callable[[Trial], None] | None = None,
) -> TuneResult:
    """Bayesian optimisation of the skip set over ``trials`` measured trials (see the module doc)."""
    try:
        import optuna
    except ImportError:
        raise ValueError("augur tune-layer-skip needs the tools extra: pip install 'augur[tools]'") from None
    from tqdm import tqdm

    config = dataclasses.replace(config, speculative_method="layer-skip", layer_skip_config=None)
    engine = LLMEngine(config)
    proposer, L = engine.proposer, engine.runner.model.num_layers
    depth = config.num_speculative_tokens
    spec = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, num_draft_tokens=depth)
    plain = dataclasses.replace(spec, speculative=False, num_draft_tokens=None)

    def plain_rate() -> float:
        run_augur(engine, prompts[:1], 8, 1, dataclasses.replace(plain, max_tokens=8))
        return run_augur(engine, prompts, max_tokens, concurrency, plain).tokens_per_s

    before = plain_rate()
    done: list[Trial] = []

    def objective(trial: optuna.Trial) -> float:
        attn = frozenset(i for i in range(L) if trial.suggest_int(f"attention.{i}", 0, 1))
        mlp = frozenset(i for i in range(L) if trial.suggest_int(f"mlp.{i}", 0, 1))
        skip = LayerSkip(attn, mlp)
        try:
            proposer.skip = skip.check(L)
        except ValueError:  # every sublayer skipped: the draft would compute nothing
            raise optuna.TrialPruned() from None
        t = measure(engine, prompts, spec, concurrency)
        trial.set_user_attr("mean_acceptance_length", t.mean_acceptance_length)
        done.append(t)
        if on_trial is not None:
            on_trial(t)
        return t.tokens_per_s

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.GPSampler(seed=seed, n_startup_trials=min(10, trials))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for s in starting_points(L)[:trials]:
        attn, mlp = (
            {f"{k}.{i}": int(i in part) for i in range(L)} for k, part in (("attention", s.attn), ("mlp", s.mlp))
        )
        study.enqueue_trial(attn | mlp)
    bar = tqdm(total=trials, desc="augur tune-layer-skip", unit="trial", disable=not progress)

    def advance(study: optuna.Study, _: optuna.trial.FrozenTrial) -> None:
        bar.update(1)
        if done:
            best = max(done, key=lambda t: t.tokens_per_s)
            bar.set_postfix(best=f"{best.tokens_per_s:.1f} tok/s", plain=f"{before:.1f}")

    try:
        study.optimize(objective, n_trials=trials, callbacks=[advance])
    finally:
        bar.close()
    if not done:
        raise ValueError("no trial could be measured")
    best = confirm(engine, done, prompts, spec, concurrency)
    after = plain_rate()
    return TuneResult(best, done, (before + after) / 2, depth)


def confirm(
    engine: LLMEngine,
    done: list[Trial],
    prompts: list[list[int]],
    params: SamplingParams,
    concurrency: int,
    top: int = 3,
) -> Trial:
    """The best of the ``top`` fastest skip sets, each timed twice more: the fastest of many noisy
    timings is partly luck (the winner's curse), the median of three much less so."""
    fastest: dict[LayerSkip, Trial] = {}  # each skip set's fastest trial (a set may be tried twice)
    for t in done:
        if t.skip not in fastest or t.tokens_per_s > fastest[t.skip].tokens_per_s:
            fastest[t.skip] = t
    finalists = sorted(fastest.values(), key=lambda t: -t.tokens_per_s)[:top]
    scored = []
    for t in finalists:
        engine.proposer.skip = t.skip
        again = [measure(engine, prompts, params, concurrency) for _ in range(2)]
        runs = sorted([t, *again], key=lambda r: r.tokens_per_s)
        scored.append(runs[1])  # the median run
    return max(scored, key=lambda t: t.tokens_per_s)


def write_result(result: TuneResult, path: str | Path, model: str) -> Path:
    path = Path(path)
    path.write_text(json.dumps(result.to_dict(model), indent=2) + "\n")
    return path
