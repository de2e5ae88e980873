"""Multi-turn episodes, token in / token out: the loop (`grpo.episodes.loop`: `ToolEngine`, `Episode`), the model's
tool-call format (`grpo.episodes.formats`: parsing, the chat template's tool suffix), the tools and their calls
(`grpo.episodes.tools`) and the per-turn metrics (`grpo.episodes.metrics`). Imported by module name:
``from grpo.episodes.loop import ToolEngine``.
"""
