"""Reward functions with TRL's signature that misbehave on purpose (used by tests/test_reliability.py)."""

import os

from grpo.tasks.rewards import gsm8k_exact_answer_reward

_calls = 0


def nan_on_rank0_second_call(completions, **kwargs) -> list[float]:
    """1.0 for every completion, except NaN on rank 0's second call (its step 2): only one rank sees it."""
    global _calls
    _calls += 1
    bad = _calls == 2 and os.environ.get("RANK", "0") == "0"
    return [float("nan") if bad else 1.0 for _ in completions]


def flat_for_two_steps(completions, **kwargs) -> list[float]:
    """The same reward for every completion in the first two rollout steps (zero advantages: no update), then one
    that tells the completions of every group apart whatever they say (their position's parity)."""
    global _calls
    _calls += 1
    return [1.0 if _calls <= 2 else float(i % 2) for i in range(len(completions))]


def exact_answer_then_sigkill_rank0_in_sync(completions, answer, **kwargs) -> list[float]:
    """grpo.tasks.rewards' exact-answer reward; with SIGKILL_RANK0_IN_SYNC=<k> in the environment (set by the test for
    one run only), rank 0 kills itself with SIGKILL in the weight sync that follows its k-th call: after
    /start_weight_update, while the server's workers wait for the LoRA factors of the update."""
    global _calls
    _calls += 1
    if os.environ.get("RANK", "0") == "0" and str(_calls) == os.environ.get("SIGKILL_RANK0_IN_SYNC"):
        import signal
        import time

        from merge.lora_merge import trainer as lora_merge_trainer

        def killed_while_sending(group, tensor):
            time.sleep(1.0)  # /update_weights reaches the server: its workers wait in the broadcast
            print("SIGKILL rank 0 in the weight sync, before the factors are sent", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        lora_merge_trainer.broadcast = killed_while_sending  # the trainer's side only: the server is another process
    return gsm8k_exact_answer_reward(completions, answer)
