"""Faults during a run, end to end (2 processes, FSDP2, vLLM): interruption, resume, NaN/inf, lost checkpoints."""

import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from recipe_runs import REFERENCE_RUN, ROOT, forked_launch, launch, launch_command, launch_env, read_metrics
from transformers import AutoModelForCausalLM

# everything a step computes that does not depend on the clock
DETERMINISTIC = [
    "rollout_step",
    "global_step",
    "reward_mean",
    "reward_std",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "clip_frac",
    "rollout_logprob_diff_mean",
    "rollout_tokens",
    "loss",
    "lr",
]


def checkpoint_step(checkpoint) -> int:
    return json.loads((checkpoint / "trainer_state.json").read_text())["rollout_step"]


def test_sigterm_checkpoints_and_resume_matches_an_uninterrupted_run(tmp_path, tiny_model, reference_run):
    """The uninterrupted run is the shared reference run (tests/recipe_runs.py's REFERENCE_RUN: held-out
    evaluations between the steps, whose sampling a resumed run must redo as they were)."""
    _, _, metrics = reference_run
    assert [m["rollout_step"] for m in metrics] == [1, 2, 3, 4]

    # Interrupt a longer run as a terminal or a cluster scheduler would: SIGTERM to every process of the job.
    out, log = tmp_path / "interrupted", tmp_path / "interrupted.log"
    with open(log, "w") as sink:  # a file, not a pipe: a full pipe would block the run
        proc = subprocess.Popen(
            launch_command(out, tiny_model, *REFERENCE_RUN, "max_steps=40"),
            cwd=ROOT,
            env=launch_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + 600
        while not read_metrics(out) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=300)
    stderr = log.read_text()
    assert proc.returncode != 0
    checkpoints = sorted((out / "run").glob("checkpoint-*"))
    assert len(checkpoints) == 1 and not list((out / "run").glob("*.tmp")), checkpoints
    stopped_at = checkpoint_step(checkpoints[0])
    assert 1 <= stopped_at < 4, stopped_at
    assert f"resume_from_checkpoint={checkpoints[0]}" in stderr
    assert not (out / "run" / "adapter").exists()  # the final adapter is written only by a finished run
    saved = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(checkpoints[0]))
    assert any("lora_B" in n for n, _ in saved.named_parameters())  # peft loads the checkpoint's adapter

    # Resume in place (short alias, newest checkpoint): the steps after the checkpoint equal the uninterrupted run's.
    resumed, metrics_after = launch(out, tiny_model, *REFERENCE_RUN, "resume_from=last")
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert f"continuing at rollout step {stopped_at + 1} of 4" in resumed.stderr
    assert [m["rollout_step"] for m in metrics_after] == [1, 2, 3, 4]  # earlier lines kept, later ones redone once
    for got, want in zip(metrics_after, metrics):
        assert {k: got[k] for k in DETERMINISTIC} == pytest.approx({k: want[k] for k in DETERMINISTIC}, rel=1e-9)
    # what made the run: its first part, and the resumed part under "resumes"
    made = json.loads((out / "run" / "provenance.json").read_text())
    assert made["commit"] == made["resumes"][0]["commit"] and len(made["resumes"]) == 1
    assert made["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and "torch" in made["packages"]


def test_nan_reward_on_one_rank_stops_every_rank_and_keeps_the_checkpoint(legacy_slice_nan_reward_run, tiny_model):
    """(The run reads its log-probs with the legacy slice as well: tests/test_grpo_e2e.py checks that part.)"""
    out, proc, metrics = legacy_slice_nan_reward_run
    assert proc.returncode != 0
    assert "step 2, rewards: non-finite reward from faulty_rewards:nan_on_rank0_second_call" in proc.stderr
    last_good = out / "run" / "checkpoint-2"
    assert f"the last good checkpoint is {last_good}" in proc.stderr
    assert [m["rollout_step"] for m in metrics] == [1]
    assert sorted(p.name for p in (out / "run").glob("checkpoint-*")) == ["checkpoint-2"]
    assert checkpoint_step(last_good) == 1
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(last_good))


def test_nonfinite_loss_stops_before_the_update(tmp_path, tiny_model):
    """A learning rate of 1e30 makes the weights huge at the first update (rollout step 3: the reward is flat before);
    the first NaN/inf stops the step before optimizer.step(), naming the last good checkpoint. Run in fp16, where the
    huge fp32 LoRA weights also overflow in the next forward (cast to fp16) and its loss scaling is armed: the loss
    is checked by the same collective check in every dtype (`grpo.faults.stop_if_nonfinite`), fp32 included."""
    proc, metrics = launch(
        tmp_path,
        tiny_model,
        "learning_rate=1e30",
        "save_steps=2",
        "model.dtype=float16",
        "reward_funcs=[faulty_rewards:flat_for_two_steps]",
    )
    assert proc.returncode != 0
    assert "non-finite loss" in proc.stderr and "stopped before the optimizer update" in proc.stderr
    failed_step = len(metrics) + 1
    assert f"step {failed_step}, iteration 1, mini-batch" in proc.stderr
    checkpoints = sorted((tmp_path / "run").glob("checkpoint-*"), key=checkpoint_step)
    assert checkpoints and checkpoint_step(checkpoints[-1]) == failed_step - 1
    assert f"the last good checkpoint is {checkpoints[-1]}" in proc.stderr


def test_tools_that_exit_chdir_and_hang_end_only_their_calls_and_sigterm_stops_within_the_grace(
    tmp_path, tiny_tool_model
):
    """tests/faulty_tools.py's calculator changes the working directory at every call, ends its calls of rollout
    step 1 with SystemExit(3) or KeyboardInterrupt, then hangs (tool_calling.timeout_s=60); output_dir is relative.
    Step 1's calls are failed calls and its metrics land in the run's folder; SIGTERM to the job while step 2's
    tools hang abandons that step, and each rank stops with its line, leaving step 1's checkpoint, before the
    launcher's 30 s grace would end it."""
    out, log = tmp_path / "out", tmp_path / "run.log"
    (tmp_path / "elsewhere").mkdir()
    env = {"FAULTY_TOOL_RUN": str(out / "run"), "FAULTY_TOOL_ELSEWHERE": str(tmp_path / "elsewhere")}
    overrides = ["tools=[faulty_tools:calculator]", "tool_calling.timeout_s=60", "save_steps=2", "eval_steps=null"]
    overrides += ["max_steps=40"]
    proc = forked_launch(
        log, Path("out"), tiny_tool_model, *overrides, config="tiny_cpu_tools.yaml", cwd=tmp_path, env=env
    )
    deadline = time.time() + 600
    while not list(out.glob("hanging-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, log.read_text()[-5000:]
    os.killpg(proc.pid, signal.SIGTERM)
    start = time.monotonic()
    proc.wait(timeout=25)  # the launcher would end the ranks at 30 s
    stopped_in = time.monotonic() - start
    print(f"stopped {stopped_in:.1f} s after SIGTERM")
    stderr = log.read_text()
    [step] = read_metrics(out)
    assert step["rollout_step"] == 1 and step["tools/call_frequency"] > 0, step
    assert step["tools/failure_frequency"] == 1.0  # every call ended with SystemExit or KeyboardInterrupt
    checkpoints = list((out / "run").glob("checkpoint-*"))
    assert [c.name for c in checkpoints] == ["checkpoint-2"] and checkpoint_step(checkpoints[0]) == 1
    assert "abandoning the rollout step in progress" in stderr
    for rank in (0, 1):
        assert f"[rank{rank}] stopped by SIGTERM after rollout step 1 of 20" in stderr, stderr[-5000:]
    assert f"resume_from_checkpoint={(out / 'run' / 'checkpoint-2').resolve()}" in stderr
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_tool_model), str(checkpoints[0]))


def test_a_second_signal_inside_the_first_ones_handler_leaves_its_line_whole_and_raises_nothing():
    """A scheduler signals every process of the job and the launcher passes its own signal on: a rank's second
    SIGTERM can run inside the handler of the first, here while it writes its line (from the log handler). The line
    is written whole and one RolloutAbandoned ends the wait; raising again there would cut the line off."""
    from grpo.engines.interface import RolloutAbandoned, _Abandoning, abandonable_wait, rollout_in_progress
    from grpo.faults import StopRequest

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop, lines = StopRequest(), []

    class SecondSignalWhileWriting(logging.Handler):
        def emit(self, record):
            stop.handle(signal.SIGTERM, None)
            lines.append(record.getMessage())

    logger, handler = logging.getLogger("grpo"), SecondSignalWhileWriting()
    logger.addHandler(handler)
    try:
        with pytest.raises(RolloutAbandoned), rollout_in_progress(), abandonable_wait():
            stop.handle(signal.SIGTERM, None)
    finally:
        logger.removeHandler(handler)
        _Abandoning.stopping = False
        for sig, previous in handlers.items():
            signal.signal(sig, previous)
    assert lines == [
        "SIGTERM received: abandoning the rollout step in progress, then a checkpoint of the last finished step"
    ]
    assert stop.signum == signal.SIGTERM
