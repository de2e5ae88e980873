"""Several in-process vLLM workers in one process: ``python tests/vllm_workers.py WORKER.py:OUT.json ...``.

Each worker script (tests/lora_merge_*_worker.py, tests/vllm_moe_push_worker.py) builds its own engine and writes
its figures to OUT; run here one after another, they share one interpreter's imports (~10 s each otherwise). A
worker that raises ends the process with its traceback: the workers after it are not run (tests/torchrun.py's
`vllm_workers` says so in each of their tests).
"""

import importlib
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engines in this process: LLM's own RL calls

if __name__ == "__main__":
    for spec in sys.argv[1:]:
        script, out = spec.split(":", 1)
        start = time.perf_counter()
        importlib.import_module(script.removesuffix(".py")).main(out)
        print(f"{script}: done in {time.perf_counter() - start:.1f} s", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # without the teardown of torch's and vLLM's modules (tests/torchrun.py's finish_worker)
