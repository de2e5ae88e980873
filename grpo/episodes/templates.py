"""The chat template a tool-using run renders with: one whose tool suffix follows its assistant turn token for token
(prefix-preserving), as the tool loop appends the suffix to the sampled ids. TRL 1.16's GRPOTrainer rule: where
the tokenizer's template is not prefix-preserving (Qwen3's drops earlier thinking), TRL's matching ``*_training``
template replaces it; a template TRL has no training version of is refused at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from grpo.config_parsing import ConfigError
from grpo.episodes.formats import Renderer

log = logging.getLogger(__name__)


def template_name(tokenizer) -> str:
    """The template's first line, to name it in a message (a template has no name of its own)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default", "")
    first = next((line.strip() for line in (template or "").splitlines() if line.strip()), "")
    return first[:60] + ("..." if len(first) > 60 else "")


def use_prefix_preserving_template(tokenizer, tools: list[Callable], template_kwargs: dict, model: str) -> None:
    """Put TRL's training template on ``tokenizer`` where its own is not prefix-preserving; refuse in one line a
    template that is not, with these ``template_kwargs``, and has no training version."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    fix = (
        "put a prefix-preserving chat template on the tokenizer (one that renders an assistant turn the same "
        "whatever follows it; TRL's trl/chat_templates/*_training.jinja are)"
    )
    if not is_chat_template_prefix_preserving(tokenizer):
        try:
            training = get_training_chat_template(tokenizer)
        except ValueError:  # TRL knows no training version of this template
            raise ConfigError(
                f"model {model!r}: its chat template ({template_name(tokenizer)!r}) is not prefix-preserving, so tool "
                f"responses cannot be appended to the sampled ids, and TRL has no training version of it; {fix}"
            ) from None
        log.info("model %r: its chat template is not prefix-preserving; TRL's training template replaces it", model)
        tokenizer.chat_template = training
    probe = [{"role": "tool", "name": tools[0].__name__ if tools else "tool", "content": "dummy"}]
    try:
        Renderer(tokenizer, tools, template_kwargs).tool_suffix_ids(probe)
    except ValueError:
        raise ConfigError(
            f"model {model!r}: its chat template ({template_name(tokenizer)!r}) is not prefix-preserving with "
            f"data.chat_template_kwargs={template_kwargs!r}; {fix}"
        ) from None
