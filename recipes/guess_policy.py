"""What guess-the-number runs taught the policy: its probability of binary search's guess, state by state.

    python recipes/guess_policy.py results/tiny-cpu-env-{episode,turn}-s{0,1,2} --out results/grpo_env_policy.json

Held-out success moves slowly (a game is won by eight decisions in a row); what each guess's credit should teach
first is visible in the policy itself. For each run (its config's model with its final `adapter/`) and for the model
before training: the probability that the next guess is the midpoint of the interval the last feedback named, at the
states binary search passes through in its first ``--depth`` guesses (depth 1: the first guess, 0 to 63; depth 2:
32 to 63 and 0 to 30; ...), each state's conversation as the environment renders it (its feedback after each
earlier midpoint guess), the call written as the model writes it (the number is one token). Exact probabilities of
the trainer's model in fp32: no sampling. Per run and depth the mean over that depth's states; per advantage mode the
mean and standard error across its seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from grpo.figures import read_config
from grpo.provenance import provenance
from grpo.tasks.guess_number import HIGHEST, LOWEST, GuessNumber, make_guess_problems
from grpo.tasks.tiny_guess import _call, build_guess_model, tools


def binary_search_states(depth: int) -> list[list[tuple[int, int, str]]]:
    """Per depth 1..``depth``, the states binary search reaches there, each as its earlier moves: a list of
    (guess, feedback) pairs, with the interval of the state (low, high)."""
    levels, frontier = [], [([], LOWEST, HIGHEST)]
    for _ in range(depth):
        levels.append(frontier)
        following = []
        for moves, low, high in frontier:
            middle = (low + high) // 2
            for secret in (low, high):  # one secret below the midpoint, one above: the two branches
                if secret == middle or low == high:
                    continue
                game = GuessNumber()
                game.reset()
                game.secret, game.low, game.high = secret, low, high
                feedback, _ = game.guess(middle)
                following.append((moves + [(middle, feedback)], game.low, game.high))
        frontier = following
    return levels


def midpoint_probability(model, tokenizer, question: str, moves, low: int, high: int) -> float:
    """P(the next guess is (low + high) // 2) after ``moves``: the conversation rendered by the chat template, the
    assistant's call written up to its number."""
    messages = [{"role": "user", "content": question}]
    for number, feedback in moves:
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [_call(number)]},
            {"role": "tool", "name": "guess", "content": feedback},
        ]
    middle = (low + high) // 2
    texts = [
        tokenizer.apply_chat_template(
            messages + [{"role": "assistant", "content": "", "tool_calls": [_call(n)]}], tools=tools(), tokenize=False
        )
        for n in (middle, middle + 1 if middle < HIGHEST else middle - 1)
    ]
    ids, other = (tokenizer(t, add_special_tokens=False).input_ids for t in texts)
    at = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)  # the number's token: one token per number
    with torch.no_grad():
        logits = model(torch.tensor([ids[:at]])).logits[0, -1].float()
    return logits.log_softmax(-1)[ids[at]].exp().item()


def policy_row(model, tokenizer, levels, question: str) -> list[float]:
    model.eval()
    return [
        statistics.fmean(midpoint_probability(model, tokenizer, question, m, lo, hi) for m, lo, hi in states)
        for states in levels
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="guess-the-number runs' folders (each with adapter/)")
    parser.add_argument("--depth", type=int, default=3, help="binary search's first guesses to read the policy at")
    parser.add_argument("--out", type=Path, default=Path("results/grpo_env_policy.json"))
    args = parser.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    levels = binary_search_states(args.depth)
    question = make_guess_problems(1, seed=12345)[0]["question"]
    models = {read_config(run)["model"]["name_or_path"] for run in args.runs}
    if len(models) != 1:
        raise SystemExit(f"the runs start from different models: {sorted(models)}")
    base_dir = build_guess_model(models.pop())  # the shipped build, copied there where it is not yet
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    report = dict(depth_states=[len(states) for states in levels], before=policy_row(base, tokenizer, levels, question))
    rows = []
    for run in args.runs:
        config = read_config(run)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, run / "adapter")
        probabilities = policy_row(model, tokenizer, levels, question)
        row = dict(run=str(run), advantage=config.get("advantage", "episode"), seed=config.get("seed"))
        rows.append(dict(row, midpoint_probability=probabilities))
        print(run, [round(p, 3) for p in probabilities], flush=True)
    report["runs"] = rows
    for mode in dict.fromkeys(r["advantage"] for r in rows):  # each advantage mode among the runs, in their order
        mine = [r["midpoint_probability"] for r in rows if r["advantage"] == mode]
        means = [statistics.fmean(column) for column in zip(*mine)]
        errors = [statistics.stdev(column) / len(column) ** 0.5 if len(column) > 1 else 0.0 for column in zip(*mine)]
        report[mode] = dict(seeds=len(mine), mean=means, error=errors)
    report["command"] = "python recipes/guess_policy.py " + " ".join(map(str, args.runs)) + f" --depth {args.depth}"
    report["provenance"] = provenance(Path(__file__).resolve().parents[1])
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
