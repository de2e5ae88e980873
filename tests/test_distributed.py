"""Checks with two processes (torchrun, gloo on CPU); what each rank asserts is in tests/distributed_checks.py.

The checks run one after another in one torchrun launch with other test files' two-process checks (conftest.py's
`two_process_checks`); each test asserts that its check passed on both ranks (`passed`).
"""

from torchrun import passed


def test_gradient_checkpointing_keeps_loss_and_gradients_and_lowers_memory(two_process_checks):
    passed(two_process_checks, "gradient_checkpointing")


def test_fp32_adapters_on_a_bf16_base_learn_at_small_learning_rates(two_process_checks):
    passed(two_process_checks, "bf16_adapters")


def test_ranks_holding_other_weights_are_caught_before_sharding(two_process_checks):
    passed(two_process_checks, "same_weights")


def test_a_per_node_output_dir_is_refused(two_process_checks):
    passed(two_process_checks, "shared_output_dir")


def test_every_rank_and_every_prompt_draws_its_own_samples(two_process_checks):
    passed(two_process_checks, "sampling_streams")
