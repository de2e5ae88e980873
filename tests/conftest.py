import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The embedded default model as shipped (models/tiny-qwen3-gsm8k, copied: no build): some of its answers are
    right, sampled and greedy."""
    from grpo.tasks.tiny_gsm8k import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory):
    """The embedded mixture-of-experts model (Qwen3-MoE, 8 experts, top-2), untrained: its test rewards with
    tests/stand_in_rewards.py, which needs no answer right to train."""
    from grpo.tasks.tiny_gsm8k import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-moe", size="tiny-moe", warmup_steps=0)


@pytest.fixture(scope="session")
def tiny_tool_model(tmp_path_factory):
    """The embedded tool-use model as shipped (models/tiny-qwen3-tools, copied: no build): it calls the calculator
    in well-formed JSON on most problems and copies the result right on many."""
    from grpo.tasks.tiny_tools import build_tool_model

    return build_tool_model(tmp_path_factory.mktemp("model") / "tools")


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, tiny_model):
    """The recipe with tests/recipe_runs.py's REFERENCE_RUN on the embedded model, run once per pytest run and read
    by the tests of fidelity, of the accelerate twins and of resuming; yields (output dir, process, metrics). Its
    folder is read only."""
    from recipe_runs import REFERENCE_RUN, launch

    out = tmp_path_factory.mktemp("reference")
    proc, metrics = launch(out, tiny_model, *REFERENCE_RUN)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out, proc, metrics


ENGINE_WORKERS = [  # the fault injector last: nothing it patches reaches another worker
    "vllm_moe_push_worker.py",
    "lora_merge_bf16_worker.py",
    "lora_merge_moe_worker.py",
    "lora_merge_fault_worker.py",
]


@pytest.fixture(scope="session")
def engine_workers(tmp_path_factory):
    """The in-process vLLM workers of tests/test_merge_moe.py and tests/test_server_mode.py, run once in one process
    (tests/vllm_workers.py); worker -> its figures (read them with tests/torchrun.py's `figures_of`)."""
    from torchrun import vllm_workers

    return vllm_workers(ENGINE_WORKERS, tmp_path_factory.mktemp("engine-workers"))


@pytest.fixture(scope="session")
def legacy_slice_nan_reward_run(tmp_path_factory, tiny_model):
    """One run for two tests whose settings do not touch each other: the trainer's log-probs read with the legacy
    slice (padding.legacy_slice: the ratio blows up) and a NaN reward on rank 0 at rollout step 2 (every rank stops
    before that step's update, the checkpoint of step 1 kept); yields (output dir, process, metrics)."""
    from recipe_runs import launch

    out = tmp_path_factory.mktemp("legacy-slice-nan-reward")
    overrides = ["padding.legacy_slice=true", "save_steps=2", "reward_funcs=[faulty_rewards:nan_on_rank0_second_call]"]
    proc, metrics = launch(out, tiny_model, *overrides)
    return out, proc, metrics


@pytest.fixture(scope="session")
def two_process_checks(tmp_path_factory, tiny_model):
    """tests/distributed_checks.py's checks and the FSDP2 workers of other test files, run once in one torchrun
    launch (tests/torchrun.py's TWO_PROCESS_CHECKS); each test asserts its own with tests/torchrun.py's `passed`."""
    from torchrun import TWO_PROCESS_CHECKS, torchrun

    tmp = tmp_path_factory.mktemp("two-process-checks")
    (tmp / "sampling_streams").mkdir()
    (tmp / "sampling_streams" / "model").symlink_to(tiny_model)
    checks = ",".join(TWO_PROCESS_CHECKS)
    # RSS follows the live tensors: the memory checks compare peaks
    return torchrun("distributed_checks.py", checks, str(tmp), MALLOC_MMAP_THRESHOLD_="65536")
