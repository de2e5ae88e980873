"""Rollout engines: the interface (`Engine`, `Sample`, `EngineStateError`), the colocated engine
(`grpo.engines.colocated`), the client of a separate ``vllm serve`` (`grpo.engines.server`), and `prepare_engine`
(`grpo.engines.build`), which checks and starts the one a config asks for. Imported by module name, as the rest of
grpo: ``from grpo.engines.build import prepare_engine``.
"""
