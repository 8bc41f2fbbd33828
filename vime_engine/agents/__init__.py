"""Built-in agents: custom generate functions (`--custom-generate-function-path`) and their tools."""
