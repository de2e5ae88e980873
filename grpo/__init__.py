"""The parts of the GRPO recipes (`recipes/`), one idea per module; the recipes import them as `grpo.<module>`.

config (the YAML config: TRL GRPOConfig names, peft LoraConfig names under `lora:`), run (start-up and the run's
state), data (prompts, TRL-style rewards, batches), loss (TRL 1.16's GRPO loss as pure functions), rollout_engine
(the colocated vLLM engine, merged weights or adapter), parallel (processes, FSDP2, collectives), metrics, faults
(NaN/inf, signals, the |vLLM - trainer| guard), checkpointing, trackers, memory_plan, tiny_gsm8k (the embedded
default: model, data, reward), qwen3_4b_shape (a random model of Qwen3-4B's architecture), bench_common (what the
benchmarks share).
"""
