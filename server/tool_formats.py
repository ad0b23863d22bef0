"""Which call syntax a served model writes: named by ``--tool-call-parser``, or read from its chat template
(``auto``). The syntaxes themselves are in server/tools.py (the JSON ones, DeepSeek's among them, and
gpt-oss's harmony), server/tool_xml.py (Qwen3-Coder's and Qwen3.5's XML, Seed-OSS's, GLM-4.5's and 4.7's,
MiniMax-M2's),
server/tool_pythonic.py (a Python list of calls: Llama 3.2's, Llama 4's, Gemma 3's), server/tool_kimi.py
(Kimi K2's) and server/tool_gemma4.py (Gemma 4's)."""

from __future__ import annotations

import dataclasses
import re

from server.harmony import CHANNEL
from server.tool_gemma4 import GEMMA4, GEMMA4_FORMAT
from server.tool_kimi import KIMI, KIMI_K2
from server.tool_pythonic import PythonicCallFormat
from server.tool_xml import GLM45, GLM47, MINIMAX_M2, SEED_OSS, XmlCallFormat
from server.tools import DEEPSEEK, FORMATS, HarmonyFormat, ToolFormat

CallSyntax = ToolFormat | HarmonyFormat | XmlCallFormat | PythonicCallFormat  # (Gemma4Format is a ToolFormat)
# (Mistral's v11 syntax is "mistral" too: the template says which.)
TOOL_PARSERS: dict[str, CallSyntax] = {
    **{k: v for k, v in FORMATS.items() if k != "mistral_v11"},
    "qwen3_coder": XmlCallFormat(),
    "seed_oss": XmlCallFormat("seed_oss", SEED_OSS),
    "glm45": XmlCallFormat("glm45", GLM45),
    "glm47": XmlCallFormat("glm47", GLM47),
    "minimax_m2": XmlCallFormat("minimax_m2", MINIMAX_M2),
    "kimi_k2": KIMI_K2,
    "gemma4": GEMMA4_FORMAT,
    "pythonic": PythonicCallFormat(),
    "harmony": HarmonyFormat(),
}


def mistral_format(chat_template: str | None) -> ToolFormat:
    """The Mistral call syntax a chat template writes: v11's ``[TOOL_CALLS]NAME[ARGS]{...}`` (with the
    model's own ``[CALL_ID]`` where the template writes one, as Mistral Small 3.2's does), or the
    JSON list, after a blank where the template writes one (Mistral 7B v0.3's ``[TOOL_CALLS] [``)."""
    t = chat_template or ""
    if "[ARGS]" in t:
        return dataclasses.replace(FORMATS["mistral_v11"], id_sep="[CALL_ID]" if "[CALL_ID]" in t else "")
    return (
        dataclasses.replace(FORMATS["mistral"], open="[TOOL_CALLS] [") if "[TOOL_CALLS] [" in t else FORMATS["mistral"]
    )


def detect_format(chat_template: str | None) -> CallSyntax:
    """The call syntax a chat template teaches its model; Hermes-style where it says nothing (the
    fallback template writes that style)."""
    t = chat_template or ""
    if CHANNEL in t:  # harmony (gpt-oss): messages on channels
        return TOOL_PARSERS["harmony"]
    if "[TOOL_CALLS]" in t:
        return mistral_format(t)
    if GEMMA4[0] in t:  # Gemma 4's: <|tool_call>call:NAME{key:value}<tool_call|>
        return TOOL_PARSERS["gemma4"]
    if KIMI[0] in t:  # Kimi K2's: each call named by its id, functions.NAME:INDEX
        return TOOL_PARSERS["kimi_k2"]
    if DEEPSEEK[0] in t:  # V3's and R1's fence each call's arguments as JSON; V3.1's do not
        fmt = FORMATS["deepseek_v3" if "```json" in t else "deepseek_v31"]
        return dataclasses.replace(fmt, text_arguments=re.search(r"\['arguments'\]\s*\+", t) is not None)
    if "<seed:tool_call>" in t:  # Seed-OSS's: Qwen's elements in its own tags
        return TOOL_PARSERS["seed_oss"]
    if "<minimax:tool_call>" in t:  # MiniMax-M2's: <invoke> elements in one block
        return TOOL_PARSERS["minimax_m2"]
    if "<tool_call>" in t and "<function=" in t and "<parameter=" in t:  # Qwen3-Coder's and Qwen3.5's XML
        return TOOL_PARSERS["qwen3_coder"]
    if "<tool_call>" in t and "<arg_key>" in t:  # GLM's: 4.7's writes its tags without line ends between
        return TOOL_PARSERS["glm47" if "</arg_key><arg_value>" in t else "glm45"]
    if "<tool_call>" in t:
        return FORMATS["hermes"]
    if "<|tool_call|>" in t:  # Granite 3's
        return FORMATS["granite"]
    if "func_name1(" in t:  # the pythonic templates' own example: [func_name1(params_name1=params_value1, ...)]
        return TOOL_PARSERS["pythonic"]
    if "functools[" in t:  # Phi-4-mini's
        return FORMATS["phi4_mini_json"]
    if "<|python_tag|>" in t or "ipython" in t:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def tool_format(name: str, chat_template: str | None, tokenizer) -> CallSyntax:
    """The syntax ``--tool-call-parser name`` gives a model with this template and vocabulary."""
    fmt = detect_format(chat_template) if name == "auto" else TOOL_PARSERS[name]
    if name == "mistral":  # which of Mistral's syntaxes, its template says
        fmt = mistral_format(chat_template)
    return fmt.bind(tokenizer)
