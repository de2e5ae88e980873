"""What a vLLM server must serve for a trainer to score its samples, read from its ``/server_info`` (a
``VLLM_SERVER_DEV_MODE=1`` route): `server_setting_problems` names each setting to change, for the recipe's server
engine (`grpo.engines.server.check_server_settings`) and for TRL's (`merge.trl`) alike; `cache_salt_problems`
asks a prefix-caching server whether it keeps apart what each request's ``cache_salt`` says to."""

from __future__ import annotations

import secrets


def server_setting_problems(config: dict, merge: bool = True) -> list[str]:
    """The problems, each with the flag that fixes it, of a server whose resolved ``vllm_config`` is ``config``:
    log-probs of another distribution than the one sampled, quantized weights (an online ``--quantization`` of an
    unquantized checkpoint included: a merged update would be quantized again, and the trainer scores unquantized
    weights), and, with ``merge`` (weights are pushed), data-parallel ranks behind another front end."""
    model_config = config.get("model_config") or {}
    problems = []
    if model_config.get("logprobs_mode") != "processed_logprobs":
        problems.append(f"it returns {model_config.get('logprobs_mode')} (add --logprobs-mode processed_logprobs)")
    if model_config.get("quantization"):
        problems.append(
            f"it serves {model_config['quantization']}-quantized weights (serve the unquantized base without "
            "--quantization)"
        )
    parallel = config.get("parallel_config") or {}
    if merge and (parallel.get("data_parallel_external_lb") or parallel.get("data_parallel_hybrid_lb")):
        problems.append(
            "its data-parallel ranks are balanced by an external load balancer (--data-parallel-rank, "
            "--data-parallel-hybrid-lb): this front end reaches only its own engines, so a weight update would "
            "wait for the others; serve one data-parallel group behind one front end (internal balancing)"
        )
    return problems


def cache_salt_problems(url: str, block_size: int, max_model_len: int) -> list[str]:
    """What keeps a prefix-caching server from honouring ``cache_salt``, found by asking it: one prompt a block and
    a token long, sent three times, and the cached tokens of each (``usage.prompt_tokens_details``). The second
    (same salt) shows the cache works; the third (another salt) must find none of it, or a block cached under one
    weight version could serve another's request. Random ids (the system's randomness, not the run's RNG): no two
    ranks' probes share a block. Empty when nothing is wrong, or when no prompt fits a whole block (none is cached)."""
    import random

    import requests

    if max_model_len < block_size + 2:
        return []
    model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    prompt = [random.SystemRandom().randrange(8, 64) for _ in range(block_size + 1)]
    salts = [f"probe-{secrets.token_hex(8)}" for _ in range(2)]

    def cached_tokens(salt: str) -> int | None:
        sampling = dict(max_tokens=1, detokenize=False)
        body = dict(token_ids=prompt, model=model, cache_salt=salt, sampling_params=sampling)
        reply = requests.post(f"{url}/inference/v1/generate", json=body, timeout=120)
        reply.raise_for_status()
        return cached_prompt_tokens(reply.json())

    cached_tokens(salts[0])  # fills the cache
    again, other = cached_tokens(salts[0]), cached_tokens(salts[1])
    if again is None:
        return ["it caches prefixes without reporting a request's cached tokens (add --enable-prompt-tokens-details)"]
    if other:
        return [
            f"its prefix cache ignores cache_salt ({other} of a {len(prompt)}-token prompt cached under another "
            "salt were reused): KV computed with one weight version could serve the next (--no-enable-prefix-caching)"
        ]
    return []


def cached_prompt_tokens(reply: dict) -> int | None:
    """The prompt tokens a ``/inference/v1/generate`` reply says the prefix cache served (``usage.prompt_tokens_
    details``: reported by a server started with ``--enable-prompt-tokens-details``), or None when it says nothing."""
    return ((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
