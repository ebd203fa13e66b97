"""Chat templates of the model families whose tool-call formats the gateway speaks (gateway/structured/tool_formats/)."""
