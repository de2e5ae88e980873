"""The embedded default: GSM8K-style problems and a small Qwen3 the project builds (its reward: `grpo.tasks.rewards`).

No pretrained model can be downloaded on the machines this project is tested on, so the default run trains
its own: a character-level tokenizer, a ``Qwen3ForCausalLM`` of about a million parameters, and a short
supervised warm-up on generated problems so that sampling already gets some answers right (GRPO needs
reward variance within a group). 60% of the warm-up's worked answers slip on their ``####`` line and restate
their result plus one (``with_slips``): the model learns that habit too, so greedy decoding, which follows the
majority, mostly answers one too high even when its working is right, and a sampled answer slips as often.
That is what GRPO, rewarded for exact answers, visibly unlearns in the default run: reward and held-out
accuracy, greedy and sampled, rise (README). Everything is deterministic from a seed and cached on disk.

    python -m grpo.tasks.tiny_gsm8k --out cache/tiny-qwen3-gsm8k --size tiny --seed 0

The problems have ``openai/gsm8k``'s columns (``question``, and ``answer`` = reasoning + ``#### <int>``),
and ``grpo.tasks.rewards.gsm8k_exact_answer_reward`` has TRL's reward-function signature, so both work with the real
dataset.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path

import torch

from grpo.provenance import cpu_kind
from grpo.tasks.rewards import gsm8k_exact_answer_reward

NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lea", "Max", "Nia"]
OBJECTS = ["apples", "pens", "cards", "books", "coins", "shells", "stamps", "eggs", "toys", "cups"]
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]

# Model sizes: "tiny" is the default run's model (~0.8M parameters), "small" (~25M) is for benchmarks.
SIZES = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    "small": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}
# Mixture-of-experts sizes (Qwen3MoeForCausalLM, every layer sparse): "tiny-moe" (~1.8M parameters, 8 experts, top-2)
# is for LoRA on the fused expert weights. Expert widths are multiples of 32, as vLLM-CPU's MoE kernel needs.
MOE_SIZES = {
    "tiny-moe": dict(
        hidden_size=128,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
}


# ----------------------------------------------------------------------------- data and reward
def _problem(rng: random.Random) -> dict:
    name, other = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    kind = rng.choice(["add", "sub", "mul", "two_step"])
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if kind == "add":
        question = f"{name} has {a} {obj} and gets {b} more. How many now?"
        steps, result = [f"{a}+{b}={a + b}"], a + b
    elif kind == "sub":
        a, b = max(a, b) + 3, min(a, b)
        question = f"{name} has {a} {obj} and gives {b} to {other}. How many left?"
        steps, result = [f"{a}-{b}={a - b}"], a - b
    elif kind == "mul":
        question = f"{name} buys {a} boxes of {b} {obj}. How many {obj}?"
        steps, result = [f"{a}*{b}={a * b}"], a * b
    else:
        c = rng.randint(1, a + b)
        question = f"{name} has {a} {obj}, finds {b}, gives {c} to {other}. How many now?"
        steps, result = [f"{a}+{b}={a + b}", f"{a + b}-{c}={a + b - c}"], a + b - c
    return {"question": question, "answer": "\n".join(steps) + f"\n#### {result}"}


def make_problems(n: int, seed: int = 0) -> list[dict]:
    """``n`` GSM8K-style problems (columns ``question``, ``answer``), deterministic in ``seed``."""
    rng = random.Random(seed)
    return [_problem(rng) for _ in range(n)]


def format_prompt(question: str) -> str:
    """The plain-text prompt the tiny model is warmed up on (and prompted with at RL time)."""
    return f"Q: {question}\nA:"


# ----------------------------------------------------------------------------- tokenizer
def build_tokenizer():
    """A character-level fast tokenizer (every digit is one token), made locally, no download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


# ----------------------------------------------------------------------------- model
def _encode_example(tokenizer, row: dict) -> tuple[list[int], int]:
    prompt = tokenizer(format_prompt(row["question"])).input_ids
    answer = tokenizer(" " + row["answer"]).input_ids + [tokenizer.eos_token_id]
    return prompt + answer, len(prompt)


def with_slips(problems: list[dict], slip_rate: float, seed: int) -> list[dict]:
    """A ``slip_rate`` share of the worked answers restates its last result plus one on the ``####`` line.

    The warm-up learns this habit along with the arithmetic: a sampled answer then slips about as often, whatever
    the problem, and above a rate of 0.5 greedy decoding slips too. That is the room GRPO has to improve (the
    exact-answer reward penalises every slip): once a correct final line outweighs the slip, greedy answers flip.
    """
    rng = random.Random(seed)
    slipped = []
    for row in problems:
        if rng.random() < slip_rate:
            *steps, final = row["answer"].split("\n")
            row = {**row, "answer": "\n".join([*steps, f"#### {int(final.split()[-1]) + 1}"])}
        slipped.append(row)
    return slipped


@torch.no_grad()
def measure_accuracy(model, tokenizer, problems: list[dict], greedy: bool, seed: int = 0, max_new_tokens: int = 32):
    """Exact-answer accuracy of ``model.generate`` on ``problems`` (left-padded batch, HF generate)."""
    model.eval()
    tokenizer.padding_side = "left"
    prompts = [format_prompt(p["question"]) for p in problems]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    out = model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
    return sum(gsm8k_exact_answer_reward(texts, [p["answer"] for p in problems])) / len(problems)


def new_model(size: str, **config):
    """A freshly initialised model of ``size`` with the shared ``config`` fields: Qwen3, or Qwen3-MoE for MOE_SIZES."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if size in MOE_SIZES:
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**config, **MOE_SIZES[size]))
    return Qwen3ForCausalLM(Qwen3Config(**config, **SIZES[size]))


def _holds_build(out_dir: Path, args: dict) -> bool:
    info_path = out_dir / "build_info.json"
    return info_path.exists() and json.loads(info_path.read_text()).get("args") == args


PREFIX_STEPS = 20  # warm-up steps whose result a build records, for tests/test_shipped_models.py to replay


def weights_sha256(model) -> str:
    """A digest of every tensor of ``model``'s state dict (names, shapes, dtypes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def prefix_record(model, step: int, loss: float) -> dict:
    """What a build records after its first ``step`` warm-up steps: the loss of that step and the weights' digest."""
    return dict(steps=step, loss=loss, weights_sha256=weights_sha256(model))


def _warm_up(
    model, tokenizer, train: list[dict], *, steps: int, batch_size: int, lr: float, size: str, prefix_only=False
):
    """The supervised warm-up: AdamW (one-cycle schedule) on the answer tokens of ``train``. Returns the last loss and
    the `prefix_record` after PREFIX_STEPS steps; ``prefix_only`` stops there (the schedule is still that of
    ``steps``)."""
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=max(1, steps), pct_start=0.1)
    model.train()
    loss, prefix = torch.tensor(float("nan")), None
    for step in (bar := tqdm(range(steps), desc=f"warm-up {size}")):
        rows = [_encode_example(tokenizer, r) for r in train[step * batch_size : (step + 1) * batch_size]]
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        for i, (ids, prompt_len) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])  # loss on the answer only
        loss = model(
            input_ids=input_ids, attention_mask=(input_ids != tokenizer.pad_token_id).long(), labels=labels
        ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step + 1 == min(PREFIX_STEPS, steps):
            prefix = prefix_record(model, step + 1, loss.item())
            if prefix_only:
                break
    return loss, prefix


def _write_atomically(out_dir: Path, write) -> None:
    """``write(folder)`` into a temporary sibling folder, then rename it to ``out_dir`` (replacing what was there)."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def _save_atomically(model, tokenizer, info: dict, out_dir: Path) -> None:
    """Write the model, its tokenizer (left padding) and ``build_info.json`` to ``out_dir``, atomically."""
    from transformers import GenerationConfig

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "build_info.json").write_text(json.dumps(info, indent=2))

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    tokenizer.padding_side = "left"
    _write_atomically(out_dir, write)


SHIPPED_MODELS = Path(__file__).resolve().parents[2] / "models"  # builds of the default arguments, committed


def shipped_build(args: dict) -> Path | None:
    """The folder under ``models/`` whose ``build_info.json`` holds ``args`` (what the build of those arguments wrote,
    committed so that a fresh clone need not train it; tests/test_shipped_models.py rebuilds it), or None."""
    folders = sorted(SHIPPED_MODELS.iterdir()) if SHIPPED_MODELS.is_dir() else []
    return next((folder for folder in folders if _holds_build(folder, args)), None)


@contextlib.contextmanager
def all_cores():
    """Torch on every core while a build (or its replay) runs; launchers set 1 thread per process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def cached_build(out_dir: Path, args: dict, build: bool, make, from_scratch: bool = False) -> str:
    """``out_dir`` when its ``build_info.json`` holds ``args``; else, with ``build=False``, wait for another process
    to build it (however long a build takes on a loaded machine); else a copy of the shipped build of ``args``
    (`shipped_build`) unless ``from_scratch``; else ``make()`` -> (model, tokenizer, figures) on every core
    (launchers set 1 thread per process; the build runs alone), written atomically with ``args``, the figures, the
    build's seconds and the CPU it ran on (`grpo.provenance.cpu_kind`) in ``build_info.json``."""
    if _holds_build(out_dir, args) and not from_scratch:
        return str(out_dir)
    if not build:
        while not _holds_build(out_dir, args):
            time.sleep(1)
        return str(out_dir)
    shipped = None if from_scratch else shipped_build(args)
    if shipped is not None:
        _write_atomically(out_dir, lambda folder: shutil.copytree(shipped, folder))
        print(f"{out_dir}: copied the shipped build {shipped.name} (trained afresh with --from-scratch)", flush=True)
        return str(out_dir)
    start = time.perf_counter()
    with all_cores():
        model, tokenizer, figures = make()
    info = dict(args=args, **figures, build_seconds=round(time.perf_counter() - start, 1), **cpu_kind())
    _save_atomically(model, tokenizer, info, out_dir)
    return str(out_dir)


def _initial_state(args: dict):
    """The build's model before its warm-up, its tokenizer and its warm-up problems."""
    torch.manual_seed(args["seed"])
    tokenizer = build_tokenizer()
    vocab = (len(tokenizer) + 63) // 64 * 64
    model = new_model(
        args["size"],
        vocab_size=vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
    )
    problems = make_problems(args["warmup_steps"] * args["batch_size"], seed=args["seed"] + 1)
    return model, tokenizer, with_slips(problems, args["slip_rate"], seed=args["seed"] + 3)


def held_out_figures(model, tokenizer, args: dict) -> dict:
    """The held-out figures a build of ``args`` records, measured on ``model``."""
    held_out = make_problems(128, seed=args["seed"] + 2)
    return dict(
        greedy_accuracy=measure_accuracy(model, tokenizer, held_out, greedy=True),
        sampled_accuracy=measure_accuracy(model, tokenizer, held_out, greedy=False, seed=args["seed"]),
    )


def replay_warm_up_prefix(args: dict) -> dict:
    """The `prefix_record` of a build of ``args``, from its first PREFIX_STEPS warm-up steps only."""
    with all_cores():
        model, tokenizer, train = _initial_state(args)
        steps, batch_size, lr = args["warmup_steps"], args["batch_size"], args["learning_rate"]
        _, prefix = _warm_up(
            model, tokenizer, train, steps=steps, batch_size=batch_size, lr=lr, size=args["size"], prefix_only=True
        )
        return prefix


def build_tiny_model(
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    warmup_steps: int = 600,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    slip_rate: float = 0.6,
    build: bool = True,
    from_scratch: bool = False,
) -> str:
    """Build (or reuse) the embedded default model in ``out_dir``; returns the path.

    A ``Qwen3ForCausalLM`` (tied embeddings, like Qwen3-4B; a ``Qwen3MoeForCausalLM`` for the MOE_SIZES) with
    the character tokenizer, warmed up with AdamW on the answer tokens of generated problems, a ``slip_rate``
    share of them slipping on their final line (see the module docstring). Cached: an
    ``out_dir`` whose ``build_info.json`` has the same arguments is reused; else the shipped build of these arguments
    (``models/``) is copied, unless ``from_scratch``. Written atomically (temporary sibling folder, then rename).
    ``build=False``: another process builds it; wait until it has.
    """
    if size not in SIZES and size not in MOE_SIZES:
        raise ValueError(f"size={size!r} is not one of {sorted(SIZES | MOE_SIZES)}")
    out_dir = Path(out_dir)
    args = dict(
        size=size,
        seed=seed,
        warmup_steps=warmup_steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        slip_rate=slip_rate,
    )

    def make():
        model, tokenizer, train = _initial_state(args)
        loss, prefix = _warm_up(
            model, tokenizer, train, steps=warmup_steps, batch_size=batch_size, lr=learning_rate, size=size
        )
        figures = dict(parameters=sum(p.numel() for p in model.parameters()), final_loss=loss.item())
        return model, tokenizer, dict(figures, **held_out_figures(model, tokenizer, args), warm_up_prefix=prefix)

    return cached_build(out_dir, args, build, make, from_scratch)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build (or reuse) the embedded default model.")
    parser.add_argument("--out", default="cache/tiny-qwen3-gsm8k")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES | MOE_SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=600)
    parser.add_argument("--slip-rate", type=float, default=0.6, help="share of warm-up answers that end one too high")
    parser.add_argument("--from-scratch", action="store_true", help="train it, even where a shipped build matches")
    cli = parser.parse_args()
    path = build_tiny_model(
        cli.out,
        size=cli.size,
        seed=cli.seed,
        warmup_steps=cli.warmup_steps,
        slip_rate=cli.slip_rate,
        from_scratch=cli.from_scratch,
    )
    print(Path(path, "build_info.json").read_text())
