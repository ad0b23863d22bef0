"""The cost table's sorting of py-spy samples into stages (loadtest/cost_table.py)."""

from __future__ import annotations

import pytest

from loadtest.cost_table import API_STAGES, ENGINE_STAGES, classify_raw, per_token_ms

ENGINE = (
    'process 11:"python augur serve";thread (12): augur-engine;Thread._bootstrap (threading.py:1002);'
    "Thread.run (threading.py:982);AsyncEngine._run (engine/core/async_engine.py:333)"
)
STEP = ENGINE + ";LLMEngine.step (engine/core/llm_engine.py:311);Step.run (engine/core/step.py:79)"
API = (
    "thread (11): MainThread;<module> (augur:8);Server.run (uvicorn/server.py:86);"
    "BaseEventLoop.run_forever (asyncio/base_events.py:607);BaseEventLoop._run_once (asyncio/base_events.py:1884)"
)
AHEAD = ENGINE + ";LLMEngine.step (engine/core/llm_engine.py:338);LLMEngine._step_ahead (engine/core/llm_engine.py:405)"
RUNNER = "ModelRunner.execute (engine/runner/model_runner.py:421);Module._call_impl (torch/nn/modules/module.py:1784)"


@pytest.mark.parametrize(
    "stack,stage",
    [
        (
            STEP
            + ";Step.target_forward (engine/core/step.py:192);ModelRunner.forward (engine/runner/model_runner.py:470);"
            + RUNNER,
            "target forward",
        ),
        (
            STEP
            + ";Step.target_forward (engine/core/step.py:192);ModelRunner.forward (engine/runner/model_runner.py:466);"
            "ModelRunner.prepare (engine/runner/model_runner.py:300)",
            "batch metadata",
        ),
        (
            STEP
            + ";Step.propose (engine/core/step.py:131);LevelDrafter.propose (engine/speculative/levels.py:140);"
            + RUNNER,
            "drafting: draft forwards",
        ),
        (
            STEP + ";Step.propose (engine/core/step.py:131);LevelDrafter.propose (engine/speculative/levels.py:150);"
            "DraftModelProposer._root_logits (engine/speculative/methods/draft_model.py:140);"
            "ModelRunner.prepare (engine/runner/model_runner.py:300)",
            "batch metadata",
        ),
        (
            STEP + ";Step.propose (engine/core/step.py:140);Constraints.cut (engine/sampling/constrain.py:50)",
            "drafting: host work",
        ),
        (
            STEP + ";Step.plan (engine/core/step.py:100);SpecController.plan (engine/speculative/controller.py:300)",
            "controller (planning depths)",
        ),
        (STEP + ";Scheduler.schedule (engine/core/scheduler.py:90)", "scheduling"),
        (
            STEP
            + ";Step.target_forward (engine/core/step.py:192);ModelRunner.forward (engine/runner/model_runner.py:470);"
            "ShardedRunner.execute (engine/runner/parallel.py:180);"
            "ShardedRunner._mirrored (engine/runner/parallel.py:170);Workers.send (engine/runner/parallel.py:90);"
            "broadcast_object_list (torch/distributed/distributed_c10d.py:3400)",
            "tensor parallel: messages to the workers",
        ),
        (
            STEP
            + ";Step.target_forward (engine/core/step.py:192);ModelRunner.forward (engine/runner/model_runner.py:470);"
            + RUNNER
            + ";LlamaMLP.forward (engine/models/llama.py:112);_all_reduce (engine/parallel/__init__.py:100)",
            "tensor parallel: collectives (all-reduce, gather)",
        ),
        (
            STEP + ";Step.accept (engine/core/step.py:222);verify (engine/sampling/verify.py:67)",
            "sampling and verification",
        ),
        (STEP + ";Step.commit (engine/core/step.py:250)", "bookkeeping (commit, KV moves, hooks)"),
        (ENGINE + ";Event.wait (threading.py:629);Condition.wait (threading.py:331)", "idle"),
        (ENGINE + ";AsyncEngine._deliver (engine/core/async_engine.py:347)", "queue (requests in, outputs out)"),
        (
            ENGINE + ";AsyncEngine._deliver_all (engine/core/async_engine.py:298);"
            "BaseEventLoop.call_soon_threadsafe (asyncio/base_events.py:812)",
            "queue (requests in, outputs out)",
        ),
        (
            ENGINE + ";LLMEngine.step (engine/core/llm_engine.py:320);OutputProcessor.process "
            "(engine/core/output_processor.py:60)",
            "output processing (detokenize, stops)",
        ),
        # A run-ahead step (engine/core/ahead.py).
        (AHEAD + ";RunAhead.launch (engine/core/ahead.py:138);" + RUNNER, "target forward"),
        (
            AHEAD
            + ";RunAhead.launch (engine/core/ahead.py:137);ModelRunner.prepare (engine/runner/model_runner.py:300)",
            "batch metadata",
        ),
        (AHEAD + ";Ticket.tolist (engine/runner/readback.py:30)", "sampling and verification"),
        (AHEAD + ";RunAhead.steady (engine/core/ahead.py:110)", "scheduling"),
        (
            AHEAD + ";LLMEngine._hand_out (engine/core/llm_engine.py:370);OutputProcessor.append "
            "(engine/core/output_processor.py:50)",
            "output processing (detokenize, stops)",
        ),
        (AHEAD + ";LLMEngine._computed_ahead (engine/core/llm_engine.py:420)", "bookkeeping (commit, KV moves, hooks)"),
        # A speculative engine asks its controller for the plan of the step it launches ahead.
        (
            AHEAD + ";LLMEngine._plans_plain (engine/core/llm_engine.py:440);Step.plan (engine/core/step.py:112);"
            "SpecController.plan (engine/speculative/controller.py:380)",
            "controller (planning depths)",
        ),
        (
            AHEAD + ";SpecController.observe_ahead (engine/speculative/controller.py:560)",
            "controller (planning depths)",
        ),
    ],
)
def test_engine_samples_land_in_their_stage(stack, stage):
    assert stage in ENGINE_STAGES
    assert classify_raw(f"{stack} 7\n")["engine"] == {stage: 7}


@pytest.mark.parametrize(
    "stack,stage",
    [
        (API + ";EpollSelector.select (selectors.py:468)", "idle"),
        (API + ";H11Protocol.data_received (uvicorn/protocols/http/h11_impl.py:200)", "HTTP and SSE"),
        (
            "thread (11): MainThread;completions (server/routes.py:80);_tokenize (server/tokens.py:40);"
            "PreTrainedTokenizerFast._batch_encode_plus (transformers/tokenization_utils_fast.py:500)",
            "tokenize",
        ),
        (
            "thread (11): MainThread;chunk (server/responses.py:120);BaseModel.model_dump_json (pydantic/main.py:470)",
            "JSON",
        ),
        ("thread (11): MainThread;AsyncEngine.generate (engine/core/async_engine.py:220)", "hand-off to the engine"),
    ],
)
def test_api_samples_land_in_their_stage(stack, stage):
    assert stage in API_STAGES
    assert classify_raw(f"{stack} 3\n")["api"] == {stage: 3}


def test_stages_per_token_sum_to_the_wall_time():
    samples = classify_raw(
        f"{STEP};Step.commit (engine/core/step.py:250) 30\n{ENGINE};Event.wait (threading.py:629) 70\n"
    )
    # 100 samples over 2 s recorded; the load ran 1 s for 100 tokens: 10 ms a token, 6 of them busy.
    ms = per_token_ms(samples["engine"], ENGINE_STAGES, recorded_s=2.0, load_s=1.0, tokens=100)
    assert ms["bookkeeping (commit, KV moves, hooks)"] == pytest.approx(6.0)
    assert ms["idle"] == pytest.approx(4.0) and sum(ms.values()) == pytest.approx(10.0)
    assert classify_raw("thread (9): augur-grammar_0;work (x.py:1) 5\n")["other"] == {"augur-grammar_0": 5}


def test_an_engine_process_is_the_engine_and_its_receiver_thread_has_a_row():
    """--engine-process on: the spawned process's main thread is the engine; the API process's
    receiver thread is its own row, apart from the event loop."""
    engine_proc = 'process 21:"python -c from multiprocessing.spawn import spawn_main; spawn_main()"'
    api_proc = 'process 11:"python augur serve"'
    raw = (
        f"{engine_proc};thread (21): MainThread;EngineCore.run (engine/core/engine_core.py:120);"
        "LLMEngine.step (engine/core/llm_engine.py:320);Step.run (engine/core/step.py:80);"
        "Step.target_forward (engine/core/step.py:160) 7\n"
        f"{engine_proc};thread (21): MainThread;EngineCore.run (engine/core/engine_core.py:113);"
        "Poller.poll (zmq/sugar/poll.py:106) 5\n"
        f"{engine_proc};thread (21): MainThread;EngineCore.run (engine/core/engine_core.py:140);"
        "EngineCore._publish (engine/core/engine_core.py:200) 2\n"
        f"{api_proc};thread (13): augur-engine-outputs;ProcessEngine._receive (engine/core/engine_core.py:390);"
        "Socket.poll (zmq/sugar/socket.py:1000) 9\n"
        f"{api_proc};thread (13): augur-engine-outputs;ProcessEngine._receive (engine/core/engine_core.py:400);"
        "EngineFront._deliver_all (engine/core/async_engine.py:250) 4\n"
        f"{api_proc};thread (11): MainThread;ProcessEngine._send (engine/core/engine_core.py:370) 1\n"
        'process 22:"python -c from multiprocessing.resource_tracker import main;main(35)";thread (22): '
        "MainThread;main (multiprocessing/resource_tracker.py:200) 8\n"
    )
    classes = classify_raw(raw)
    assert classes["engine"] == {"target forward": 7, "idle": 5, "queue (requests in, outputs out)": 2}
    assert classes["receiver"] == {"idle": 9, "outputs in (decode, hand-off to streams, hooks)": 4}
    assert classes["api"] == {"hand-off to the engine": 1}
    assert classes["other"] == {"multiprocessing helper": 8}  # not the API's event loop
