"""What a vLLM server must serve for a trainer to score its samples, read from its ``/server_info`` (a
``VLLM_SERVER_DEV_MODE=1`` route): `server_setting_problems` names each setting to change, for the recipe's server
engine (`grpo.engines.server.ServerEngine.check_settings`) and for TRL's (`merge.trl`) alike."""

from __future__ import annotations


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
