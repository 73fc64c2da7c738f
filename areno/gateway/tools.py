"""Tool calls out of a sampled turn, with vLLM's tool parsers.

vLLM ships one parser per model family's tool-call format
(`vllm.tool_parsers.ToolParserManager`: hermes, llama3_json, mistral, ...);
the gateway uses them rather than a parser of its own. A chat template whose
model writes hermes-style `<tool_call>{json}</tool_call>` (Qwen, SmolLM2,
Hermes) takes "hermes", the default. vLLM is imported on the first parse, so
a run whose agents never pass `tools` does not need it.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

from areno.errors import UserError


class ToolCallParser:
    """name: a vLLM tool parser ("hermes", ...) or "none" (the text is the answer)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name, self.tokenizer, self._parser = name, tokenizer, None

    def _get(self) -> Any:
        if self._parser is None:
            self._parser = tool_parser_class(self.name)(self.tokenizer)
        return self._parser

    def check(self) -> None:
        """Build the parser now (a bad name is the run's one-line error, at start)."""
        if self.name != "none":
            self._get()

    def parse(self, text: str, tools: list[dict] | None, call_ids: str) -> tuple[str | None, list[dict]]:
        """A turn's text -> (content, OpenAI tool_calls). Only when the request
        passed tools; call ids are `{call_ids}_{j}` (a seeded run repeats them)."""
        if not tools or self.name == "none":
            return text, []
        info = self._get().extract_tool_calls(text, None)
        if not info.tools_called:
            return text, []
        calls = [{"id": f"{call_ids}_{j}", "type": "function",
                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for j, c in enumerate(info.tool_calls)]
        return info.content, calls


def tool_parser_class(name: str) -> type:
    """vLLM's tool parser class called `name`; UserError (one line) if there is none
    or vLLM does not import."""
    try:
        # Checked with the options, before the run dir takes third-party output: vLLM's
        # import notices (Triton on CPU) must not join the one-line error.
        with contextlib.redirect_stderr(io.StringIO()):
            from vllm.tool_parsers import ToolParserManager
    except ImportError as e:
        raise UserError(f"--agent-tool-parser {name}: tool calls are parsed with vLLM's tool "
                        f"parsers, and vLLM does not import here ({e}); use --agent-tool-parser none") from e
    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError as e:
        raise UserError(f"--agent-tool-parser {name}: vLLM has no such tool parser") from e
