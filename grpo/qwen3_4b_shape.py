"""A randomly initialised model with Qwen3-4B's exact architecture: the recipe at real size, without a hub.

    python -m grpo.qwen3_4b_shape --out cache/qwen3-4b-shape              # all 36 layers, bf16 (8 GB on disk)
    python -m grpo.qwen3_4b_shape --out cache/qwen3-4b-2layers --layers 2  # the slice the CPU tests run

The config is Qwen/Qwen3-4B's config.json (36 layers, hidden 2560, 32 query and 8 key/value heads of 128, MLP
9728, vocab 151936, tied embeddings, rope theta 1e6). The tokenizer is the embedded default's character tokenizer
(its ids lie inside the 151936-row embedding). With random weights the rewards mean nothing; the shapes, the
memory and the costs are those of the real model. Then run the recipe on it:

    accelerate launch ... recipes/grpo_qwen3_4b.py --config recipes/configs/qwen3_4b_gsm8k.yaml \
        model.name_or_path=cache/qwen3-4b-shape data.name=generated data.use_chat_template=false
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

# Qwen/Qwen3-4B's config.json, less the fields that only name the released checkpoint
QWEN3_4B = dict(
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_sliding_window=False,
    max_window_layers=36,
)


def qwen3_4b_config(num_layers: int = 36, tokenizer=None):
    """Qwen3-4B's architecture (``num_layers`` of its decoder layers), with the special tokens of ``tokenizer``."""
    from transformers import Qwen3Config

    tokens = {}
    if tokenizer is not None:
        tokens = dict(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return Qwen3Config(**{**QWEN3_4B, "num_hidden_layers": num_layers, "max_window_layers": num_layers}, **tokens)


def build_qwen3_4b_shape(out_dir: str | Path, num_layers: int = 36, dtype: str = "bfloat16", seed: int = 0) -> str:
    """Build (or reuse) the model and tokenizer in ``out_dir``; returns the path. Written atomically."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from grpo.tasks.tiny_gsm8k import build_tokenizer

    out_dir = Path(out_dir)
    args = dict(num_layers=num_layers, dtype=dtype, seed=seed)
    info_path = out_dir / "build_info.json"
    if info_path.exists() and json.loads(info_path.read_text()).get("args") == args:
        return str(out_dir)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = qwen3_4b_config(num_layers, tokenizer)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))  # initializer_range 0.02
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(tmp)
    info = dict(args=args, parameters=sum(p.numel() for p in model.parameters()))
    (tmp / "build_info.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return str(out_dir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cache/qwen3-4b-shape")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    print(Path(build_qwen3_4b_shape(cli.out, cli.layers, cli.dtype, cli.seed), "build_info.json").read_text())
