"""Replay a shipped build (``models/``) cheaply: its first warm-up steps, and its held-out figures from its weights.

A build records, beside its weights, what its first ``PREFIX_STEPS`` warm-up steps gave (that step's loss and a digest
of every weight: ``build_info.json``'s ``warm_up_prefix``) and its held-out figures. Replaying those steps and
measuring the figures again on the shipped weights checks, in seconds rather than a whole build, that the code still
makes the shipped model: the model's initialisation, tokenizer, warm-up data and optimizer decide the first steps'
weights bit for bit, and the evaluation decides the figures. The whole rebuild is ``--from-scratch`` (models/README.md).

    python -m grpo.tasks.replay_shipped --out /tmp/replay.json

On another CPU kind (or with the kernels forced to another instruction set, models/README.md) the digests differ and
the loss and figures move a little; models/other_kind.json records how far on forced kernels.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from grpo.provenance import cpu_kind, package_versions
from grpo.tasks import tiny_gsm8k, tiny_guess, tiny_tools
from grpo.tasks.tiny_gsm8k import SHIPPED_MODELS, all_cores

BUILDERS = {"tiny-qwen3-gsm8k": tiny_gsm8k, "tiny-qwen3-tools": tiny_tools, "tiny-qwen3-guess": tiny_guess}


def replay(name: str) -> dict:
    """The shipped build ``name``'s warm-up prefix replayed and its held-out figures measured again, here."""
    if name not in BUILDERS:
        raise ValueError(f"{name!r} is not a shipped build: {sorted(BUILDERS)}")
    folder = SHIPPED_MODELS / name
    args = json.loads((folder / "build_info.json").read_text())["args"]
    module = BUILDERS[name]
    return dict(warm_up_prefix=module.replay_warm_up_prefix(args), figures=held_out_figures(module, folder, args))


def held_out_figures(module, folder: Path, args: dict) -> dict:
    """The held-out figures ``module``'s build records, measured again on the weights saved in ``folder``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with all_cores():
        return module.held_out_figures(model, AutoTokenizer.from_pretrained(folder), args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Replay the shipped builds' first warm-up steps and held-out figures.")
    parser.add_argument("--out", required=True, help="JSON file to write (the CPU kind and packages are recorded)")
    cli = parser.parse_args()
    record = dict(**cpu_kind(), packages=package_versions(), builds={name: replay(name) for name in BUILDERS})
    Path(cli.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
