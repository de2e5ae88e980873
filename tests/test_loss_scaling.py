"""fp16: dynamic loss scaling (grpo/loss_scaling.py) and the stop on an overflowing merged weight."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from grpo.engines.colocated import finite_or_stop
from grpo.faults import NonFiniteError
from grpo.loss_scaling import DynamicLossScale
from merge import merged_lora_params


def fp16_lora_grads(loss_scale: DynamicLossScale, loss_weight: float) -> tuple[torch.Tensor, bool]:
    """The gradient of an fp32 LoRA factor whose forward runs in fp16, as under FSDP2's param_dtype=float16."""
    torch.manual_seed(0)
    lora_a = torch.nn.Parameter(torch.randn(8, 64))  # fp32 master weight
    x = torch.randn(32, 64).half()
    y = x @ lora_a.half().t()  # fp16 compute: the gradient reaching lora_a passes through fp16
    loss = loss_weight * y.float().sum()  # dloss/dy = loss_weight, cast to fp16 on its way back
    loss_scale.scaled(loss).backward()
    finite = loss_scale.unscale_([lora_a])
    return lora_a.grad, finite


def test_a_gradient_that_underflows_in_fp16_lands_with_loss_scaling():
    # dloss/dy = 1e-9 is below half of fp16's smallest subnormal (6e-8): it rounds to zero in the fp16 backward
    plain, _ = fp16_lora_grads(DynamicLossScale(enabled=False), 1e-9)
    assert plain.abs().max() == 0  # every gradient flushed to zero: the step would not move the adapter
    scaled, finite = fp16_lora_grads(DynamicLossScale(enabled=True), 1e-9)
    assert finite and scaled.abs().min() > 0
    torch.manual_seed(0)  # the fp32 reference gradient of the same loss
    lora_a, x = torch.randn(8, 64, requires_grad=True), torch.randn(32, 64).half().float()
    (1e-9 * (x @ lora_a.t()).sum()).backward()
    assert torch.allclose(scaled, lora_a.grad, rtol=2e-2, atol=0)  # it lands, to fp16's precision


def test_an_overflow_skips_the_step_and_backs_off_then_the_scale_grows_again():
    scale = DynamicLossScale(enabled=True, init_scale=2.0**16, growth_interval=3)
    grad, finite = fp16_lora_grads(scale, 2.0)  # 2 x 2^16 overflows fp16 (65504) in the backward
    assert not finite and not bool(torch.isfinite(grad).all())
    scale.update(finite)
    assert scale.scale == 2.0**15 and scale.skipped_steps == 1
    for _ in range(3):
        scale.update(True)
    assert scale.scale == 2.0**16 and scale.skipped_steps == 1  # grown back after growth_interval clean steps
    resumed = DynamicLossScale(enabled=True)
    resumed.load_state_dict(scale.state_dict())
    assert resumed.state_dict() == scale.state_dict()


def test_disabled_scaling_is_the_identity():
    scale = DynamicLossScale(enabled=False)
    loss = torch.tensor(3.0)
    assert scale.scaled(loss) is loss and scale.unscale_([]) and scale.scale == 1.0
    scale.update(False)
    assert scale.skipped_steps == 0


def test_a_merged_weight_that_overflows_fp16_stops_the_sync_naming_it():
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    torch.manual_seed(0)
    model = get_peft_model(Qwen3ForCausalLM(config).half(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    with torch.no_grad():
        layer.base_layer.weight[0, 0] = 65000.0  # finite in fp16 ...
        layer.lora_A["default"].weight.fill_(1.0)
        layer.lora_B["default"].weight.fill_(100.0)  # ... but W + 2 * B @ A is not
    pushed = []
    with pytest.raises(NonFiniteError, match=r"merged model\.layers\.1\.self_attn\.q_proj\.weight \(float16\) holds"):
        for name, _ in finite_or_stop(merged_lora_params(model, dtype=torch.float16)):
            pushed.append(name)
    assert "model.layers.0.self_attn.q_proj.weight" in pushed  # the layers before it went through
    assert layer.base_layer.weight[0, 0] == 65000.0  # the trainer's weights are untouched
