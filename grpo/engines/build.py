"""The rollout engine a recipe config asks for (``vllm.mode``), in two steps: what can be refused is checked at
start-up, before any work; the engine itself starts once the policy is built.

    start_engine = prepare_engine(cfg, rank=rank, world=world, device_type=device.type)  # refuses here
    ...                                                                                    # policy, optimizer
    engine = start_engine()
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from grpo.config import ConfigError, RecipeConfig
from grpo.engines.colocated import ColocatedEngine, recipe_llm_kwargs
from grpo.engines.interface import Engine
from grpo.engines.server import ServerEngine, check_server, check_server_settings


def prepare_engine(cfg: RecipeConfig, *, rank: int, world: int, device_type: str) -> Callable[[], Engine]:
    """Refuse now what the configured engine cannot do (colocate: vLLM's arguments on this device; server: a
    server that is not there or lacks what the recipe needs), one line naming the setting; return the function
    that starts the engine: `ColocatedEngine` (vllm.mode=colocate) or `ServerEngine` (vllm.mode=server)."""
    if cfg.vllm.mode == "server":
        if cfg.lora.merge and cfg.lora.modules_to_save:
            raise ConfigError(
                f"vllm.mode=server: lora.modules_to_save={cfg.lora.modules_to_save} would never reach the server (the "
                "lora_merge backend sends LoRA factors only); drop them, or train with vllm.mode=colocate"
            )
        url, model, merge = cfg.vllm.server_url, cfg.model.name_or_path, cfg.lora.merge
        check_server(url, model, merge=merge)
        check_server_settings(url, model, dtype=cfg.model.dtype, max_model_len=cfg.max_model_len, merge=merge)
        return functools.partial(ServerEngine.from_config, cfg, rank=rank, world=world, device_type=device_type)
    llm_kwargs = recipe_llm_kwargs(cfg, rank=rank, world=world, device_type=device_type)  # built once, checked now
    return functools.partial(ColocatedEngine.from_config, cfg, llm_kwargs)
