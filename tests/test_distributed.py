"""Checks with two processes (torchrun, gloo on CPU); what each rank asserts is in tests/distributed_checks.py."""

from torchrun import torchrun


def run_check(check: str, tmp_path, **env) -> None:
    torchrun("distributed_checks.py", check, str(tmp_path), ok_marker=f"{check} OK", **env)


def test_gradient_checkpointing_keeps_loss_and_gradients_and_lowers_memory(tmp_path):
    run_check("gradient_checkpointing", tmp_path, MALLOC_MMAP_THRESHOLD_="65536")  # RSS follows the live tensors


def test_fp32_adapters_on_a_bf16_base_learn_at_small_learning_rates(tmp_path):
    run_check("bf16_adapters", tmp_path)


def test_ranks_holding_other_weights_are_caught_before_sharding(tmp_path):
    run_check("same_weights", tmp_path)


def test_a_per_node_output_dir_is_refused(tmp_path):
    run_check("shared_output_dir", tmp_path)


def test_every_rank_and_every_prompt_draws_its_own_samples(tmp_path, tiny_model):
    (tmp_path / "model").symlink_to(tiny_model)
    run_check("sampling_streams", tmp_path)
