"""The shipped builds (``models/``): a fresh clone copies them instead of training, and the build still makes them.

On the CPU a shipped build was made on (``build_info.json``'s ``cpu`` and ``cpu_capability``: the model name and the
kernels torch dispatches to) the replay of its first warm-up steps and of its held-out figures
(``grpo.tasks.replay_shipped``) reproduces it bit for bit; on another kind, whose kernels round differently, within
tolerances derived from the replay on forced kernels (``models/other_kind.json``, models/README.md).
"""

import json

import pytest

from grpo.provenance import cpu_kind
from grpo.tasks.replay_shipped import replay
from grpo.tasks.tiny_gsm8k import PREFIX_STEPS, SHIPPED_MODELS, build_tiny_model
from grpo.tasks.tiny_tools import build_tool_model

BUILDS = {"tiny-qwen3-gsm8k": build_tiny_model, "tiny-qwen3-tools": build_tool_model}
NOT_PARAMETERS = ("task", "size")  # recorded in the tool build's arguments, fixed by build_tool_model
# The replay on kernels forced to another instruction set (models/README.md gives its command)
FORCED_KERNELS = json.loads((SHIPPED_MODELS / "other_kind.json").read_text())
# the accuracies among episodes that did (not) call the tool divide by a count that itself moves: left out
CONDITIONAL = ("sampled_accuracy_with_tool", "sampled_accuracy_without_tool")


def other_kind_tolerance(name: str) -> dict:
    """How far another CPU kind's replay may move: four times what the forced kernels moved it, and at least 1e-3
    of the loss and two of the 128 held-out problems for a rate (a sampled token that other rounding flips)."""
    info = json.loads((SHIPPED_MODELS / name / "build_info.json").read_text())
    forced = FORCED_KERNELS["builds"][name]
    loss_moved = abs(forced["warm_up_prefix"]["loss"] / info["warm_up_prefix"]["loss"] - 1)
    rate_moved = max(abs(v - info[k]) for k, v in forced["figures"].items() if k not in CONDITIONAL)
    return dict(prefix_loss_relative=max(4 * loss_moved, 1e-3), rate=max(4 * rate_moved, 2 / 128))


def build_arguments(name: str) -> dict:
    args = json.loads((SHIPPED_MODELS / name / "build_info.json").read_text())["args"]
    if name == "tiny-qwen3-tools":
        assert args["size"] == "tiny", args
        return {k: v for k, v in args.items() if k not in NOT_PARAMETERS}
    return args


def test_a_fresh_build_copies_the_shipped_one_without_training(tmp_path, monkeypatch):
    import grpo.tasks.tiny_gsm8k
    import grpo.tasks.tiny_tools

    def refuse(*args, **kwargs):
        raise AssertionError("trained although a shipped build matches")

    monkeypatch.setattr(grpo.tasks.tiny_gsm8k, "_warm_up", refuse)
    monkeypatch.setattr(grpo.tasks.tiny_tools, "_warm_up", refuse)
    for name, build in BUILDS.items():
        out = tmp_path / name
        assert build(out, **build_arguments(name)) == str(out)
        shipped = sorted(p.name for p in (SHIPPED_MODELS / name).iterdir())
        assert sorted(p.name for p in out.iterdir()) == shipped
        for file in shipped:
            assert (out / file).read_bytes() == (SHIPPED_MODELS / name / file).read_bytes(), file
    other = dict(build_arguments("tiny-qwen3-gsm8k"), seed=1)  # no shipped build of these: it trains
    with pytest.raises(AssertionError, match="trained although"):
        build_tiny_model(tmp_path / "seed-1", **other)


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_the_build_reproduces_the_shipped_model(name):
    """The build's first warm-up steps, replayed, give the weights it recorded, and its held-out figures come again
    from the shipped weights (grpo.tasks.replay_shipped): on the CPU kind it was made on, bit for bit."""
    info = json.loads((SHIPPED_MODELS / name / "build_info.json").read_text())
    replayed = replay(name)
    prefix, figures = replayed["warm_up_prefix"], replayed["figures"]
    assert prefix["steps"] == info["warm_up_prefix"]["steps"] == min(PREFIX_STEPS, info["args"]["warmup_steps"])
    assert set(figures) <= set(info) and "sampled_accuracy" in figures, figures
    here = cpu_kind()
    if (here["cpu"], here["cpu_capability"]) == (info["cpu"], info["cpu_capability"]):
        assert prefix == info["warm_up_prefix"]
        assert figures == {k: info[k] for k in figures}
        return
    tolerance = other_kind_tolerance(name)
    loss = tolerance["prefix_loss_relative"]
    assert prefix["loss"] == pytest.approx(info["warm_up_prefix"]["loss"], rel=loss), (prefix, info["warm_up_prefix"])
    for key in set(figures) - set(CONDITIONAL):
        assert abs(figures[key] - info[key]) <= tolerance["rate"], (key, figures[key], info[key])


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_the_forced_kernel_replay_ran_other_kernels_on_the_shipped_builds(name):
    """models/other_kind.json, the tolerances' source, is a replay of these builds on another kernel level: its
    warm-up weights differ from the recorded ones (the kernels rounded otherwise), its arguments are the builds'."""
    info = json.loads((SHIPPED_MODELS / name / "build_info.json").read_text())
    forced = FORCED_KERNELS["builds"][name]
    assert FORCED_KERNELS["cpu_capability"] != info["cpu_capability"]
    assert forced["warm_up_prefix"]["steps"] == info["warm_up_prefix"]["steps"]
    assert forced["warm_up_prefix"]["weights_sha256"] != info["warm_up_prefix"]["weights_sha256"]
    assert set(forced["figures"]) <= set(info)
    assert other_kind_tolerance(name)["rate"] < 0.2  # tighter than the bound of sampling noise alone
