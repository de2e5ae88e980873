"""Checks with two processes (torchrun, gloo on CPU); what each rank asserts is in tests/distributed_checks.py.

The checks run one after another in one torchrun launch (module fixture); each test asserts that its check passed on
both ranks. The vLLM engine's check is last: its shutdown may take the default process group with it.
"""

import pytest
from torchrun import torchrun

CHECKS = ["gradient_checkpointing", "bf16_adapters", "same_weights", "shared_output_dir", "sampling_streams"]


@pytest.fixture(scope="module")
def checks_run(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("distributed")
    (tmp / "sampling_streams").mkdir()
    (tmp / "sampling_streams" / "model").symlink_to(tiny_model)
    # RSS follows the live tensors (gradient_checkpointing compares peaks)
    return torchrun("distributed_checks.py", ",".join(CHECKS), str(tmp), check=False, MALLOC_MMAP_THRESHOLD_="65536")


def passed(run, check: str) -> None:
    ok = run.stdout.count(f"{check} OK")
    assert ok == 2, f"{check}: OK on {ok} of 2 ranks\n{run.stdout[-4000:]}\n{run.stderr[-6000:]}"


def test_gradient_checkpointing_keeps_loss_and_gradients_and_lowers_memory(checks_run):
    passed(checks_run, "gradient_checkpointing")


def test_fp32_adapters_on_a_bf16_base_learn_at_small_learning_rates(checks_run):
    passed(checks_run, "bf16_adapters")


def test_ranks_holding_other_weights_are_caught_before_sharding(checks_run):
    passed(checks_run, "same_weights")


def test_a_per_node_output_dir_is_refused(checks_run):
    passed(checks_run, "shared_output_dir")


def test_every_rank_and_every_prompt_draws_its_own_samples(checks_run):
    passed(checks_run, "sampling_streams")
