"""The request fields other servers take that Augur's request models do not declare: each one is
accepted (it changes nothing here, and the table says why) or refused with a 400 that names it, unless
its value asks for nothing. A field in no table is refused too (``Unknown parameter``, as OpenAI answers),
so nothing that would change the output is ever dropped in silence.

docs/fields.md lists every request field of OpenAI's, vLLM's and SGLang's chat and completions APIs
with what Augur does with it; tests/test_fields.py walks that table against a live server.
"""

from __future__ import annotations

from typing import Any


class Refused(ValueError):
    """A field refused by name (the request models turn it into a 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# Accepted whatever their value: they change nothing in what is generated or returned here.
NO_EFFECT = {
    "metadata": "stored completions are not kept; metadata changes nothing",
    "store": "stored completions are not kept",
    "service_tier": "one tier",
    "prompt_cache_key": "the prefix cache needs no key",
    "prompt_cache_retention": "the prefix cache keeps what fits",
    "prompt_cache_options": "the prefix cache keeps what fits",
    "safety_identifier": "no abuse tracking",
    "prediction": "a latency hint: the output is the model's either way",
    "session_id": "one engine: nothing to route",
    "stream_interval": "a stream sends what each step produced",
    "watermarking": "no watermark is configured, so there is none to opt out of",
    "data_parallel_rank": "one engine: nothing to route",
    "routed_dp_rank": "one engine: nothing to route",
    "disagg_prefill_dp_rank": "no prefill/decode disaggregation",
    "bootstrap_host": "no prefill/decode disaggregation",
    "bootstrap_port": "no prefill/decode disaggregation",
    "bootstrap_room": "no prefill/decode disaggregation",
    "custom_labels": "no per-request metric labels",
}

# Refused unless their value asks for nothing: one of ``ASK_NOTHING``, or where the field lists its own
# such values (a flag whose default is true), one of those or null. What they ask for is not built here,
# and would change the output or its shape.
ASK_NOTHING = (None, False, 0, "", [], {})
REFUSED: dict[str, tuple[str, tuple]] = {
    # OpenAI's
    "audio": ("audio output is not supported", ()),
    "modalities": ("only text output is supported", (["text"],)),
    "web_search_options": ("web search is not built", ()),
    "moderation": ("no moderation is run: nothing would check the output", ()),
    "verbosity": ("verbosity other than medium is not supported", ("medium",)),
    # vLLM's
    "echo": ("chat echo (the last message prepended to the answer) is not supported; /v1/completions has echo", ()),
    "add_special_tokens": (
        "the prompt's special tokens are fixed: the chat template's on chat, the tokenizer's (BOS) on completions",
        (),
    ),  # fmt: skip
    "spaces_between_special_tokens": ("special tokens are decoded without spaces between them", (True,)),
    "truncate_prompt_tokens": ("prompts are not truncated: a prompt that does not fit is a 400", ()),
    "truncation_side": ("prompts are not truncated", ()),
    # (0 still asks for something in vLLM: each prompt token's own logprob)
    "prompt_logprobs": ("not supported: /v1/completions gives the prompt's logprobs with echo and logprobs", (None,)),
    "logprob_token_ids": ("logprobs of fixed token ids are not supported", ()),
    "allowed_token_ids": ("a token whitelist is not supported: use structured_outputs or logit_bias", ()),
    "bad_words": ("banned words are not supported: use logit_bias or structured_outputs", ()),
    "documents": ("documents for the chat template are not supported: put them in the messages", ()),
    "chat_template": ("a per-request chat template is not accepted: start the server with --chat-template", ()),
    "media_io_kwargs": ("multimodal input is not supported", ()),
    "mm_processor_kwargs": ("multimodal input is not supported", ()),
    "priority": ("priority scheduling is not built (requests run in arrival order)", ()),
    "request_id": ("the server makes its own ids", ()),
    "rid": ("the server makes its own ids", ()),
    "return_tokens_as_token_ids": ("logprob tokens are returned as text", ()),
    "return_token_ids": ("token ids are not returned in responses (/tokenize gives them)", ()),
    "return_weight_versions": ("weight versions are not tracked", ()),
    "routed_experts_prompt_start": ("no mixture-of-experts routing data is returned", ()),
    "return_token_offsets": ("a render endpoint's option", ()),
    "return_prompt_text": ("the rendered prompt is not returned (/tokenize renders it)", ()),
    "mm_payload": ("a render endpoint's option", ("tensors", "none")),
    "return_mm_kwargs": ("a render endpoint's option", ()),
    "kv_transfer_params": ("no prefill/decode disaggregation", ()),
    "ec_transfer_params": ("no encoder-cache disaggregation", ()),
    "vllm_xargs": ("no logits-processor plugins", ()),
    "repetition_detection": ("repetition detection is not built: use no_repeat_ngram_size or the penalties", ()),
    "prompt_embeds": ("prompts as embeddings are not supported", ()),
    "structural_tag": ("structural tags are not supported: use structured_outputs or forced tool calls", ()),
    "logits_processors": ("per-request logits processors are not supported", ()),
    "guided_json": ('vLLM\'s guided_json was removed: use structured_outputs {"json": ...} or response_format', ()),
    "guided_regex": ('vLLM\'s guided_regex was removed: use structured_outputs {"regex": ...}', ()),
    "guided_choice": ('vLLM\'s guided_choice was removed: use structured_outputs {"choice": [...]}', ()),
    "guided_grammar": ('vLLM\'s guided_grammar was removed: use structured_outputs {"grammar": ...}', ()),
    "guided_whitespace_pattern": ('use structured_outputs {"whitespace_pattern": ...}', ()),
    "guided_decoding_backend": ("the grammar engine is llguidance, server-wide", ()),
    "return_assistant_tokens_mask": ("not returned", ()),
    # SGLang's
    "thinking": ("SGLang's thinking switch: use chat_template_kwargs or reasoning_effort", ()),
    "task": ("DeepSeek-V4 task tokens are not supported", ()),
    "stop_regex": ("stop regexes are not supported: use stop strings", ()),
    "lora_path": ("LoRA adapters are not supported", ()),
    "session_params": ("sessions are not supported", ()),
    "stream_reasoning": ("reasoning always streams as it is written", (True,)),
    "max_dynamic_patch": ("multimodal input is not supported", ()),
    "min_dynamic_patch": ("multimodal input is not supported", ()),
    "use_audio_in_video": ("multimodal input is not supported", ()),
    "images_config": ("multimodal input is not supported", ()),
    "video_config": ("multimodal input is not supported", ()),
    "custom_logit_processor": ("custom logit processors are not supported", ()),
    "custom_params": ("custom logit processors are not supported", ()),
    "watermark": ("watermarks are not supported", ()),
    "input_ids": ("chat takes messages: send token ids to /v1/completions", ()),
    "return_hidden_states": ("hidden states are not returned", ()),
    "return_routed_experts": ("no mixture-of-experts routing data is returned", ()),
    "routed_experts_start_len": ("no mixture-of-experts routing data is returned", ()),
    "return_cached_tokens_details": ("usage.prompt_tokens_details.cached_tokens is always returned", ()),
    "return_spec_tokens_details": ("usage.speculative is always returned", ()),
    "return_prompt_token_ids": ("token ids are not returned in responses (/tokenize gives them)", ()),
    "return_meta_info": ("no meta info is returned", ()),
    "return_input_ids_in_sglext": ("token ids are not returned in responses", ()),
    "return_output_ids_in_sglext": ("token ids are not returned in responses", ()),
    "return_sampling_mask": ("sampling masks are not returned", ()),
    "sampling_logprobs_mode": ("logprobs are the model's own", ()),
    "return_flat_raw_output_top_logprobs": ("top logprobs come in OpenAI's shape", ()),
    "return_flat_raw_top_logprobs_b64": ("top logprobs come in OpenAI's shape", (True,)),
    "extra_key": ("the prefix cache has no per-request namespaces", ()),
}
# Values that ask for nothing on one endpoint only: completions add the tokenizer's special tokens (BOS)
# to a text prompt, as add_special_tokens true asks; chat renders them with the template (false).
ENDPOINT_FINE = {("completions", "add_special_tokens"): (True,)}


def screen(body: Any, declared: set[str], endpoint: str) -> Any:
    """The body with the fields that change nothing here taken out; :class:`Refused` (a 400 naming the
    field) for a field that asks for what is not built, or one no table knows. ``endpoint``: "chat" or
    "completions"."""
    if not isinstance(body, dict):
        return body
    out = {}
    for key, value in body.items():
        if key in declared:
            out[key] = value
        elif key in NO_EFFECT:
            continue
        elif key in REFUSED:
            reason, fine = REFUSED[key]
            fine = ENDPOINT_FINE.get((endpoint, key), fine)
            if not _asks_nothing(value, fine):
                raise Refused(f"{key}: {reason}", key)
        else:
            raise Refused(f"Unknown parameter: '{key}' (docs/fields.md lists the fields Augur takes)", key)
    return out


def _asks_nothing(value: Any, fine: tuple) -> bool:
    values = (None, *fine) if fine else ASK_NOTHING
    return any(value == v and type(value) is type(v) for v in values)
