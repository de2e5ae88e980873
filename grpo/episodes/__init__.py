"""Multi-turn episodes, token in / token out: the loop (`grpo.episodes.loop`: `ToolEngine`, `Episode`), the model's
tool-call format (`grpo.episodes.parsers`: the family's own parser; `grpo.episodes.formats`: the chat template's
tool suffix; `grpo.episodes.tool_text`: tool output kept as text), the tools and their calls
(`grpo.episodes.tools`), the per-turn metrics (`grpo.episodes.metrics`) and the guard on reward without tool
calls (`grpo.episodes.tool_watch`). Imported by module name:
``from grpo.episodes.loop import ToolEngine``.
"""
