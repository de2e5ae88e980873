"""grpo/loss.py against TRL 1.16's own code, on the same tensors.

The loss and its gradient come from ``GRPOTrainer._compute_loss`` on a trainer built without ``__init__``: only
the attributes that method reads are set, and ``_get_per_token_logps_and_entropies`` returns the test's tensors.
The high-entropy mask comes from ``GRPOTrainer.get_high_entropy_mask``. TRL computes the vLLM importance-sampling
ratio inline in ``_generate_and_score_completions``: those two ``if`` blocks are cut out of TRL's installed
source (``inspect.getsource``) and executed as they are, so nothing of TRL is copied into this file.
"""

import inspect
import itertools
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from grpo.loss import (
    LossSettings,
    accumulate_stats,
    grpo_loss,
    high_entropy_mask,
    reduce_op,
    vllm_importance_sampling_ratio,
)
from grpo.loss_settings import check_supported

B, T = 10, 7
LENGTHS = [7, 5, 3, 1, 0, 6, 7, 4, 2, 6]  # ragged completions, a one-token one, and a fully masked row
ADVANTAGES = [1.2, -0.7, 0.0, 0.9, -1.1, -0.3, 0.8, -1.5, 0.4, -0.6]
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"]
IS_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
IS_CLIP = dict(vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=1.25)  # hit both bounds
OTHER_MINIBATCH_TOKENS = 23  # num_items_in_batch also counts the generation batch's other mini-batch


def trl_config(**fields) -> GRPOConfig:
    base = dict(
        output_dir="unused",
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=B,
        num_generations=2,
        use_vllm=True,
    )
    return GRPOConfig(**{**base, **fields})


class AcceleratorStub:
    """The accelerate calls ``_compute_loss`` makes, as one process that reports ``num_processes``."""

    def __init__(self, num_processes=1):
        self.num_processes = num_processes

    def gather(self, tensor):
        return tensor

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor


def trl_trainer(config, per_token_logps=None, entropies=None, accelerator=None, gradient_accumulation_steps=1):
    """A GRPOTrainer with exactly what _compute_loss reads, set as GRPOTrainer.__init__ sets it from ``config``."""
    trainer = object.__new__(GRPOTrainer)
    trainer.args = config
    trainer.loss_type = config.loss_type
    trainer.importance_sampling_level = config.importance_sampling_level
    trainer.epsilon_low = config.epsilon
    trainer.epsilon_high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
    trainer.beta = config.beta
    trainer.top_entropy_quantile = config.top_entropy_quantile
    trainer.off_policy_mask_threshold = config.off_policy_mask_threshold
    trainer.use_vllm = config.use_vllm
    trainer.vllm_importance_sampling_correction = config.vllm_importance_sampling_correction
    trainer.vllm_importance_sampling_mode = config.vllm_importance_sampling_mode
    trainer.vllm_importance_sampling_clip_min = config.vllm_importance_sampling_clip_min
    trainer.vllm_importance_sampling_clip_max = config.vllm_importance_sampling_clip_max
    trainer.max_completion_length = config.max_completion_length
    trainer.aux_loss_enabled = False
    trainer._entropy_bonus_enabled = config.entropy_coef != 0.0 or config.use_adaptive_entropy
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = accelerator or AcceleratorStub()
    trainer.current_gradient_accumulation_steps = gradient_accumulation_steps
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (per_token_logps, entropies, None)
    return trainer


def rollout(dtype=torch.float64, seed=0):
    """Random [B, T] tensors; padding holds junk (not zeros), so a missed mask shows."""
    generator = torch.Generator().manual_seed(seed)

    def noise(scale):
        return scale * torch.randn(B, T, generator=generator, dtype=dtype)

    old = -3 * torch.rand(B, T, generator=generator, dtype=dtype)
    sampling = old + noise(0.15)
    sampling[0, 2] = math.nan  # vLLM gave no log-prob for this token
    entropies = 3 * torch.rand(B, T, generator=generator, dtype=dtype)
    entropies[1, 1] = entropies[0, 3]  # a tie
    return dict(
        mask=(torch.arange(T) < torch.tensor(LENGTHS)[:, None]).long(),  # TRL's completion_mask is int64
        logps=old + noise(0.4),  # ratios well outside [0.8, 1.28] and beyond delta
        old=old,
        ref=old + noise(0.3),
        sampling=sampling,
        entropies=entropies,
        advantages=torch.tensor(ADVANTAGES, dtype=dtype),
    )


def loss_fields(loss_type, level, delta, beta, bias_correction, is_mode, quantile, **extra):
    """GRPOConfig fields of one combination; cispo's epsilon_high is its cap on the ratio, so > 1."""
    fields = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        delta=delta,
        beta=beta,
        use_bias_correction_kl=bias_correction,
        top_entropy_quantile=quantile,
        epsilon=0.2,
        epsilon_high=1.3 if loss_type == "cispo" else 0.28,
        steps_per_generation=2,
        vllm_importance_sampling_correction=is_mode is not None,
    )
    if is_mode is not None:
        fields.update(vllm_importance_sampling_mode=is_mode, **IS_CLIP)
    return {**fields, **extra}


def both_losses(config, data, accelerator=None, gradient_accumulation_steps=1, num_processes=1):
    """(TRL's loss, its gradient, TRL's metrics), (our loss, its gradient, our stats) on the same tensors."""
    settings = LossSettings.from_config(config, num_processes=num_processes)
    mask = data["mask"]
    ratio = None
    if settings.vllm_importance_sampling_correction:
        ratio, _ = vllm_importance_sampling_ratio(
            data["old"],
            data["sampling"],
            mask,
            settings.vllm_importance_sampling_mode,
            settings.vllm_importance_sampling_clip_min,
            settings.vllm_importance_sampling_clip_max,
        )
    num_items = mask.sum() + OTHER_MINIBATCH_TOKENS

    theirs_logps = data["logps"].clone().requires_grad_()
    trainer = trl_trainer(config, theirs_logps, data["entropies"], accelerator, gradient_accumulation_steps)
    inputs = dict(
        prompt_ids=torch.ones(B, 1, dtype=torch.long),
        prompt_mask=torch.ones(B, 1, dtype=torch.long),
        completion_ids=torch.ones(B, T, dtype=torch.long),
        completion_mask=mask,
        advantages=data["advantages"],
        old_per_token_logps=data["old"],
        num_items_in_batch=num_items,
    )
    if settings.beta != 0.0:
        inputs["ref_per_token_logps"] = data["ref"]
    if ratio is not None:
        inputs["importance_sampling_ratio"] = ratio
    theirs = trainer._compute_loss(None, inputs)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_logps)

    ours_logps = data["logps"].clone().requires_grad_()
    entropy_mask = None
    if settings.top_entropy_quantile < 1.0:
        entropy_mask = high_entropy_mask(data["entropies"], mask, settings.top_entropy_quantile)
    ours, stats = grpo_loss(
        ours_logps,
        data["old"],
        data["advantages"],
        mask,
        settings,
        ref_per_token_logps=data["ref"] if settings.beta != 0.0 else None,
        importance_sampling_ratio=ratio,
        entropy_mask=entropy_mask,
        num_items_in_batch=num_items if settings.loss_type in ("dapo", "cispo") else None,
    )
    (ours_grad,) = torch.autograd.grad(ours, ours_logps)
    return (theirs, theirs_grad, trainer._metrics["train"]), (ours, ours_grad, stats)


def trl_metrics_from_stats(stats):
    """TRL's _compute_loss metrics (one process), rebuilt from our sums and counts."""
    metrics = {}
    if "kl_sum" in stats:
        metrics["kl"] = stats["kl_sum"] / stats["tokens"]
    if "cispo_clip" in stats:
        metrics["cispo_clip_ratio"] = stats["cispo_clip"] / stats["ratio_count"]
    if "clip_low" in stats:
        for side in ("low", "high", "region"):
            metrics[f"clip_ratio/{side}_mean"] = stats[f"clip_{side}"] / stats["ratio_count"]
        metrics["clip_ratio/low_min"] = stats["clip_low_seq_fraction_min"]
        metrics["clip_ratio/high_max"] = stats["clip_high_seq_fraction_max"]
    return {name: float(value) for name, value in metrics.items()}


# ----------------------------------------------------------------------------------------------------------
# 1. loss, gradient and metrics: every supported combination
# ----------------------------------------------------------------------------------------------------------

COMBINATIONS = list(
    itertools.product(
        LOSS_TYPES,
        ["token", "sequence"],
        [None, 1.5],
        [(0.0, True), (0.04, True), (0.04, False)],
        [None, *IS_MODES],
        [1.0, 0.2],
    )
)


@pytest.mark.parametrize("loss_type, level, delta, kl, is_mode, quantile", COMBINATIONS)
def test_loss_gradient_and_metrics_equal_trl(loss_type, level, delta, kl, is_mode, quantile):
    config = trl_config(**loss_fields(loss_type, level, delta, *kl, is_mode, quantile))
    data = rollout()
    (theirs, theirs_grad, metrics), (ours, ours_grad, stats) = both_losses(config, data)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-12, atol=1e-14)
    assert ours_grad.abs().sum() > 0
    assert not ours_grad[~data["mask"].bool()].any()  # padding gets no gradient
    ours_metrics = trl_metrics_from_stats(stats)
    assert set(metrics) - {"entropy"} == set(ours_metrics)  # a metric TRL adds shows up here
    for name, value in ours_metrics.items():
        assert value == pytest.approx(metrics[name][0], rel=1e-6, abs=1e-12), name  # TRL counts in fp32


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_float32_with_trl_defaults_equal_trl(loss_type, level):
    """TRL's defaults elsewhere: vLLM correction sequence_mask with clip_max 3, beta 0, no entropy mask."""
    config = trl_config(
        loss_type=loss_type, importance_sampling_level=level, epsilon_high=5.0 if loss_type == "cispo" else None
    )
    (theirs, theirs_grad, _), (ours, ours_grad, _) = both_losses(config, rollout(torch.float32, seed=1))
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(
    "num_processes, gradient_accumulation_steps, steps_per_generation", [(1, 1, 1), (4, 1, 4), (2, 2, 4), (8, 1, 2)]
)
def test_normalisers_equal_trl(loss_type, num_processes, gradient_accumulation_steps, steps_per_generation):
    """Every process count, accumulation and mini-batch split feeds TRL's normaliser as it feeds ours."""
    config = trl_config(
        **loss_fields(
            loss_type,
            "token",
            None,
            0.04,
            True,
            "token_truncate",
            1.0,
            gradient_accumulation_steps=gradient_accumulation_steps,
            steps_per_generation=steps_per_generation,
        )
    )
    (theirs, theirs_grad, _), (ours, ours_grad, _) = both_losses(
        config, rollout(seed=2), AcceleratorStub(num_processes), gradient_accumulation_steps, num_processes
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_per_sequence_clip_extremes_skip_empty_rows_like_trl(level):
    """Every real row is low-clipped, so clip_ratio/low_min is 1 only if the empty row is left out (TRL: NaN)."""
    data = rollout(seed=9)
    data.update(logps=data["old"] - 1.0, advantages=-data["advantages"].abs() - 0.1)
    config = trl_config(**loss_fields("grpo", level, None, 0.0, True, None, 1.0))
    (theirs, theirs_grad, metrics), (ours, ours_grad, stats) = both_losses(config, data)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-12, atol=1e-14)
    expected = 1.0 if level == "token" else 0.0  # sequence level counts every row: the empty one's ratio is 1
    assert float(stats["clip_low_seq_fraction_min"]) == metrics["clip_ratio/low_min"][0] == expected
    assert float(stats["clip_high_seq_fraction_max"]) == metrics["clip_ratio/high_max"][0] == 0.0


def test_the_data_reaches_every_branch():
    """Guards the comparisons above against vacuous data: each option changes the loss here."""
    data = rollout()
    mask = data["mask"]
    ratio = torch.exp(data["logps"] - data["old"])[mask.bool()]
    negative = (data["advantages"][:, None] < 0).expand(B, T)[mask.bool()]
    assert (ratio < 0.8).any() and (ratio > 1.28).any() and (ratio[negative] > 1.5).any()  # both clips, delta
    for mode in IS_MODES:
        weights, _ = vllm_importance_sampling_ratio(
            data["old"],
            data["sampling"],
            mask,
            mode,
            **{
                "clip_min": IS_CLIP["vllm_importance_sampling_clip_min"],
                "clip_max": IS_CLIP["vllm_importance_sampling_clip_max"],
            },
        )
        kept = weights[mask.bool()] if mode.startswith("token") else weights[torch.tensor(LENGTHS) > 0]
        assert (kept != 1).any() and (kept != 0).any(), mode
        if mode.endswith("mask"):
            assert (kept == 0).any(), mode
    entropy_mask = high_entropy_mask(data["entropies"], mask, 0.2)
    assert 0 < entropy_mask.sum() < mask.sum()

    def loss_of(**fields):
        config = trl_config(
            **loss_fields(
                **{
                    **dict(
                        loss_type="grpo",
                        level="token",
                        delta=None,
                        beta=0.0,
                        bias_correction=True,
                        is_mode=None,
                        quantile=1.0,
                    ),
                    **fields,
                }
            )
        )
        return both_losses(config, data)[1][0].item()

    plain = loss_of()
    for change in [
        dict(level="sequence"),
        dict(delta=1.5),
        dict(beta=0.04),
        dict(quantile=0.2),
        *(dict(is_mode=mode) for mode in IS_MODES),
        *(dict(loss_type=t) for t in LOSS_TYPES[1:]),
    ]:
        assert loss_of(**change) != pytest.approx(plain, rel=1e-9), change
    assert loss_of(beta=0.04, bias_correction=False) != pytest.approx(loss_of(beta=0.04), rel=1e-9)


# ----------------------------------------------------------------------------------------------------------
# 2. the vLLM importance-sampling ratio: TRL's inline code, executed from its source
# ----------------------------------------------------------------------------------------------------------


def trl_if_block(method, anchor: str) -> str:
    """The ``if`` statement of ``method``'s source whose body holds the line containing ``anchor``, dedented."""
    lines = inspect.getsource(method).splitlines()

    def indent(line):
        return len(line) - len(line.lstrip())

    at = next(i for i, line in enumerate(lines) if anchor in line)
    start = next(
        i for i in range(at, -1, -1) if lines[i].lstrip().startswith("if ") and indent(lines[i]) < indent(lines[at])
    )
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].strip() and indent(lines[i]) <= indent(lines[start])),
        len(lines),
    )
    assert lines[start].strip() == "if self.use_vllm and self.vllm_importance_sampling_correction:", lines[start]
    return textwrap.dedent("\n".join(lines[start:end]))


def trl_vllm_importance_sampling(config, old, sampling, mask):
    """TRL's importance_sampling_ratio and sampling/* metrics, by running its own lines."""
    method = GRPOTrainer._generate_and_score_completions
    ratio_code = trl_if_block(method, "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps)")
    metrics_code = trl_if_block(method, "delta = torch.abs(old_per_token_logps - sampling_per_token_logps)")
    trainer = trl_trainer(config)
    scope = dict(
        torch=torch,
        math=math,
        nanmin=nanmin,
        nanmax=nanmax,
        self=trainer,
        completion_mask=mask,
        tool_mask=None,
        old_per_token_logps=old,
        sampling_per_token_logps=sampling,
        device=old.device,
        mode="train",
    )
    exec(ratio_code + "\n" + metrics_code, scope)
    return scope["vllm_importance_sampling_ratio"], {
        name.removeprefix("sampling/"): values[0] for name, values in trainer._metrics["train"].items()
    }


@pytest.mark.parametrize("mode", IS_MODES)
# (1.0, 3.0): ratios of exactly 1 (padding, the NaN token) sit on the lower bound and are kept
@pytest.mark.parametrize("clip_min, clip_max", [(None, 3.0), (0.8, 1.25), (0.8, None), (None, 1.1), (1.0, 3.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vllm_importance_sampling_ratio_equals_trl(mode, clip_min, clip_max, dtype):
    data = rollout(dtype, seed=3)
    config = trl_config(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )
    theirs, metrics = trl_vllm_importance_sampling(config, data["old"], data["sampling"], data["mask"])
    ours, stats = vllm_importance_sampling_ratio(data["old"], data["sampling"], data["mask"], mode, clip_min, clip_max)
    assert ours.shape == ((B, T) if mode.startswith("token") else (B, 1))
    assert torch.equal(ours, theirs)
    assert not ours.isnan().any()  # the NaN sampling log-prob counts as ratio 1
    assert set(metrics) == {
        "importance_sampling_ratio/min",
        "importance_sampling_ratio/mean",
        "importance_sampling_ratio/max",
        "sampling_logp_difference/mean",
        "sampling_logp_difference/max",
    }
    assert float(stats["vllm_ratio_min"]) == pytest.approx(metrics["importance_sampling_ratio/min"], rel=1e-6)
    assert float(stats["vllm_ratio_max"]) == pytest.approx(metrics["importance_sampling_ratio/max"], rel=1e-6)
    assert float(stats["vllm_ratio_sum"] / stats["vllm_ratio_count"]) == pytest.approx(
        metrics["importance_sampling_ratio/mean"], rel=1e-6
    )
    assert float(stats["vllm_logp_diff_sum"] / stats["vllm_logp_diff_count"]) == pytest.approx(
        metrics["sampling_logp_difference/mean"], rel=1e-6
    )
    assert float(stats["vllm_logp_diff_max"]) == pytest.approx(metrics["sampling_logp_difference/max"], rel=1e-6)


# ----------------------------------------------------------------------------------------------------------
# 3. the high-entropy mask
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 0.999, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_high_entropy_mask_equals_trl_for_one_process(quantile, dtype):
    data = rollout(dtype, seed=4)
    trainer = trl_trainer(trl_config())
    theirs = trainer.get_high_entropy_mask(data["entropies"], data["mask"], 1 - quantile)
    ours = high_entropy_mask(data["entropies"], data["mask"], quantile)
    assert ours.dtype == torch.bool and torch.equal(ours, theirs)
    assert not (ours & ~data["mask"].bool()).any()
    if quantile == 1.0 and dtype == torch.float32:  # (TRL rounds the threshold to fp32, so not in fp64)
        assert torch.equal(ours, data["mask"].bool())


def test_high_entropy_mask_of_no_tokens_is_empty():
    data = rollout(seed=5)
    empty = torch.zeros_like(data["mask"])
    theirs = trl_trainer(trl_config()).get_high_entropy_mask(data["entropies"], empty, 0.8)
    ours = high_entropy_mask(data["entropies"], empty, 0.2)
    assert torch.equal(ours, theirs) and not ours.any()


class TwoProcessAccelerator(AcceleratorStub):
    """Rank 0 of two; rank 1 holds ``other`` (1-D). Pads and gathers as accelerate does."""

    def __init__(self, other):
        super().__init__(num_processes=2)
        self.other = other

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        width = max(tensor.shape[0], self.other.shape[0])
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[0]), value=pad_index)

    def gather(self, tensor):
        other = torch.nn.functional.pad(self.other, (0, tensor.shape[0] - self.other.shape[0]), value=-1e9)
        return torch.cat([tensor, other])


def test_high_entropy_mask_with_a_gather_equals_trl_across_processes():
    data = rollout(torch.float32, seed=6)
    other_rank = 2.5 + torch.rand(9, generator=torch.Generator().manual_seed(7))  # higher: moves the threshold
    trainer = trl_trainer(trl_config(), accelerator=TwoProcessAccelerator(other_rank))
    theirs = trainer.get_high_entropy_mask(data["entropies"], data["mask"], 0.5)
    ours = high_entropy_mask(data["entropies"], data["mask"], 0.5, gather=lambda local: torch.cat([local, other_rank]))
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, high_entropy_mask(data["entropies"], data["mask"], 0.5))  # local differs


# ----------------------------------------------------------------------------------------------------------
# 4. settings, refusals, stats
# ----------------------------------------------------------------------------------------------------------


def test_settings_defaults_are_trls():
    assert LossSettings.from_config(trl_config()) == LossSettings()
    assert LossSettings.from_config(trl_config(use_vllm=False)).vllm_importance_sampling_correction is False
    settings = LossSettings.from_config(trl_config(epsilon=0.1), num_processes=4, steps_per_generation=3)
    assert (settings.upper_epsilon, settings.num_processes, settings.steps_per_generation) == (0.1, 4, 3)


def test_settings_from_the_recipe_config():
    from grpo.config import RecipeConfig

    recipe = RecipeConfig()
    settings = LossSettings.from_config(recipe, num_processes=2)
    assert (
        settings.loss_type,
        settings.epsilon,
        settings.beta,
        settings.steps_per_generation,
        settings.max_completion_length,
        settings.num_processes,
    ) == (recipe.loss_type, recipe.epsilon, recipe.beta, recipe.steps_per_generation, recipe.max_completion_length, 2)


@pytest.mark.parametrize(
    "field, value",
    [
        ("loss_type", "vespo"),
        ("loss_type", "ppo"),
        ("importance_sampling_level", "seq"),
        ("vllm_importance_sampling_mode", "token"),
        ("off_policy_mask_threshold", 0.5),
        ("entropy_coef", 0.01),
        ("use_adaptive_entropy", True),
        ("top_entropy_quantile", 1.5),
    ],
)
def test_unsupported_trl_options_are_refused_by_name(field, value):
    config = trl_config(**{field: value})  # TRL itself accepts each of these
    with pytest.raises(ValueError, match=rf"{field}={value!r}"):
        check_supported(config)
    with pytest.raises(ValueError, match=rf"{field}={value!r}"):
        LossSettings.from_config(config)
    if hasattr(LossSettings(), field):
        with pytest.raises(ValueError, match=rf"{field}={value!r}"):
            LossSettings(**{field: value})


def test_unusable_vllm_clip_bounds_are_refused_by_name():
    both_unset = SimpleNamespace(
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=None,
    )
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='token_truncate'"):
        check_supported(both_unset)
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_min=2.0"):
        LossSettings(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=2.0)
    LossSettings(
        vllm_importance_sampling_correction=False,
        vllm_importance_sampling_clip_min=2.0,
        vllm_importance_sampling_clip_max=2.0,
    )  # unused bounds are not checked


def test_supported_options_pass():
    for loss_type, level, mode in itertools.product(LOSS_TYPES, ["token", "sequence"], IS_MODES):
        check_supported(
            trl_config(
                loss_type=loss_type,
                importance_sampling_level=level,
                vllm_importance_sampling_mode=mode,
                top_entropy_quantile=0.2,
            )
        )


@pytest.mark.parametrize(
    "settings, missing",
    [
        (LossSettings(loss_type="grpo", beta=0.04, vllm_importance_sampling_correction=False), "ref_per_token_logps"),
        (LossSettings(loss_type="grpo"), "importance_sampling_ratio"),
        (
            LossSettings(loss_type="grpo", top_entropy_quantile=0.2, vllm_importance_sampling_correction=False),
            "entropy_mask",
        ),
        (LossSettings(vllm_importance_sampling_correction=False), "num_items_in_batch"),
    ],
)
def test_missing_inputs_are_refused_by_name(settings, missing):
    data = rollout()
    with pytest.raises(ValueError, match=f"{missing} is required"):
        grpo_loss(
            data["logps"],
            data["old"],
            data["advantages"],
            data["mask"],
            settings,
            num_items_in_batch=10 if missing != "num_items_in_batch" else None,
        )


def test_ignored_inputs_are_refused_by_name():
    data = rollout()
    settings = LossSettings(loss_type="grpo", vllm_importance_sampling_correction=False)
    for name, value in [
        ("ref_per_token_logps", data["ref"]),
        ("importance_sampling_ratio", torch.ones(B, 1)),
        ("entropy_mask", data["mask"].bool()),
        ("num_items_in_batch", 10),
    ]:
        with pytest.raises(ValueError, match=f"{name} was given"):
            grpo_loss(data["logps"], data["old"], data["advantages"], data["mask"], settings, **{name: value})


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_stats_of_two_mini_batches_add_up_to_the_whole_batch(loss_type, level):
    data = rollout(seed=8)
    settings = LossSettings(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.04,
        epsilon_high=0.28,
        vllm_importance_sampling_correction=False,
        top_entropy_quantile=0.5,
    )

    def stats_of(rows):
        part = {name: value[rows] for name, value in data.items()}
        entropy_mask = high_entropy_mask(data["entropies"], data["mask"], 0.5)[rows]  # one rollout-wide mask
        return grpo_loss(
            part["logps"],
            part["old"],
            part["advantages"],
            part["mask"],
            settings,
            ref_per_token_logps=part["ref"],
            entropy_mask=entropy_mask,
            num_items_in_batch=100 if loss_type in ("dapo", "cispo") else None,
        )[1]

    whole = stats_of(slice(None))
    total = accumulate_stats(accumulate_stats({}, stats_of(slice(0, 2))), stats_of(slice(2, None)))
    assert set(total) == set(whole)
    for name in whole:
        torch.testing.assert_close(total[name], whole[name], rtol=1e-12, atol=1e-12, msg=name)
    assert whole["tokens"] == sum(LENGTHS)
    assert whole["ratio_count"] == (sum(LENGTHS) if level == "token" else B)
    assert whole["ratio_min"] < 1 < whole["ratio_max"]


def test_reduce_op_follows_the_suffix():
    assert [reduce_op(n) for n in ["ratio_min", "clip_high_seq_fraction_max", "tokens", "kl_sum"]] == [
        "min",
        "max",
        "sum",
        "sum",
    ]
