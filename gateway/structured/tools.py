"""Tool calls: the OpenAI tool definitions and tool_choice, the constraint grammar of a turn and the parser,
in the wire format of the model's family (gateway/structured/tool_formats/; Qwen's by default).
"""

from __future__ import annotations

from .base import ConstraintKind, ConstraintSpec
from .errors import ConstraintCompileError
from .tool_formats import DEFAULT, ToolFormat
from .tool_formats.base import TEXT, ToolSpec
from .tool_formats.qwen import CLOSE as TOOL_CALL_CLOSE
from .tool_formats.qwen import OPEN as TOOL_CALL_OPEN
from .vocab import TokenizerInfo

__all__ = ["TOOL_CALL_OPEN", "TOOL_CALL_CLOSE", "ToolSpec", "tool_call_grammar", "tool_call_spec",
           "parse_tool_calls", "text_before_tool_calls"]


def _choice(tool_choice: str | dict | None) -> tuple[str, str | None]:
    """Normalise OpenAI tool_choice to (mode, forced name)."""
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ConstraintCompileError("tool_calls", f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}")
        return tool_choice, None
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not name:
        raise ConstraintCompileError("tool_calls", f"named tool_choice needs function.name: {tool_choice!r:.200}")
    return "named", name


def tool_call_grammar(
    tools: list[ToolSpec], tokenizer: TokenizerInfo, tool_choice: str | dict | None = "auto",
    parallel_tool_calls: bool = True, fmt: ToolFormat = DEFAULT,
) -> str:
    """A Lark grammar (llguidance dialect) for the assistant turn under `tool_choice`, in format `fmt`."""
    mode, forced = _choice(tool_choice)
    if mode == "none":
        return f"start: TEXT?\n{TEXT}\n"
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ConstraintCompileError("tool_calls", f"duplicate tool names in {names}")
    if forced is not None:
        if forced not in names:
            raise ConstraintCompileError("tool_calls", f"tool_choice names {forced!r}, which is not among the tools {names}")
        tools = [t for t in tools if t.name == forced]
    if not tools:
        raise ConstraintCompileError("tool_calls", f"tool_choice {mode!r} needs at least one tool")
    try:
        rules = fmt.call_rules(tools, tokenizer, parallel_tool_calls)
    except KeyError as e:
        raise ConstraintCompileError("tool_calls", f"the {fmt.name} tool-call format needs {e}") from None
    return "\n".join([fmt.start_rule(mode in ("required", "named")), *rules, TEXT]) + "\n"


def tool_call_spec(tools: list[dict], tokenizer: TokenizerInfo, tool_choice: str | dict | None = "auto",
                   parallel_tool_calls: bool = True, fmt: ToolFormat = DEFAULT) -> ConstraintSpec:
    specs = [ToolSpec.from_openai(t) for t in tools]
    starts = tuple(tokenizer.added_ids[t] for t in fmt.json_starts if t in tokenizer.added_ids)
    return ConstraintSpec(ConstraintKind.TOOL_CALLS,
                          tool_call_grammar(specs, tokenizer, tool_choice, parallel_tool_calls, fmt),
                          json_starts=starts if fmt.json_starts else None)


def parse_tool_calls(text: str, tools: list[dict] | None = None, fmt: ToolFormat = DEFAULT) -> list[dict]:
    """Every tool call of decoded text as {"name", "arguments"} dicts (ToolCallParseError if malformed)."""
    specs = {t.name: t for t in (ToolSpec.from_openai(x) for x in tools or [])}
    return fmt.parse(text, specs)


def text_before_tool_calls(text: str, fmt: ToolFormat = DEFAULT) -> str:
    """The assistant content of a turn with tool calls (OpenAI `message.content`)."""
    return fmt.text_before(text)
