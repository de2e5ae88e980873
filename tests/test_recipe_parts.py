"""Pieces of the GRPO recipe that need no launch: data loading, prompts, batches, advantages."""

import json

import pytest
import torch

from grpo.config import ConfigError, load_config
from grpo.data import group_advantages, load_problems, make_batch, reward_columns, select, tokenize_prompts
from grpo.engines.interface import Sample
from grpo.tasks.rewards import gsm8k_exact_answer_reward
from grpo.tasks.tiny_gsm8k import build_tokenizer
from padding import no_padding_2_padding, unpad


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4, "group")
    assert torch.allclose(adv[:4], (rewards[:4] - 0.25) / (rewards[:4].std() + 1e-4))
    assert torch.equal(adv[4:], torch.zeros(4))  # a group with equal rewards teaches nothing
    assert torch.allclose(group_advantages(rewards, 4, "none")[:4], rewards[:4] - 0.25)


def test_make_batch_layout_and_select_trims():
    samples = [
        Sample(
            prompt_ids=[5, 6, 7], completion_ids=[8, 9], text="", logprobs=[-0.1, -0.2], truncated=False, prompt_index=0
        ),
        Sample(
            prompt_ids=[5],
            completion_ids=[8, 9, 10, 11],
            text="",
            logprobs=[-0.3, -0.4, -0.5, -0.6],
            truncated=True,
            prompt_index=1,
        ),
    ]
    batch = make_batch(samples, pad_id=0, device=torch.device("cpu"))
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0], [0, 0, 5, 8, 9, 10, 11]]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    values = torch.arange(int(batch["attention_mask"].sum()), dtype=torch.float32)
    # the response token 8 of sample 0 is predicted at packed index 2 (its prompt's last token)
    assert no_padding_2_padding(values, batch["attention_mask"], batch["response_mask"])[0, 0] == 2
    first = select(batch, slice(0, 1))
    assert first["input_ids"].tolist() == [[5, 6, 7, 8, 9]] and first["vllm_logprobs"].shape == (1, 2)
    assert torch.equal(unpad(first["input_ids"], first["attention_mask"]).input_ids, torch.tensor([5, 6, 7, 8, 9]))


def test_local_dataset_and_chat_template(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}, {"question": "", "answer": "#### 0"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"data.name={path}", "data.system_prompt=Be brief.", "data.max_prompt_length=64"])
    problems = load_problems(cfg)
    assert problems == rows
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    kept = tokenize_prompts(cfg, tokenizer, problems)
    assert len(kept) == 2 and kept[0]["prompt"] == "system: Be brief.\nuser: What is 2+2?\nassistant:"
    assert tokenizer.decode(kept[0]["prompt_ids"]) == kept[0]["prompt"]
    short = load_config(None, [f"data.name={path}", "data.max_prompt_length=20", "data.use_chat_template=false"])
    assert [k["question"] for k in tokenize_prompts(short, tokenizer, problems)] == ["What is 2+2?"]


def test_bad_data_is_named(tmp_path):
    with pytest.raises(ConfigError, match="data.name='/no/such/data'"):
        load_problems(load_config(None, ["data.name=/no/such/data"]))
    cfg = load_config(None, ["data.prompt_template='Q: {problem}'"])
    with pytest.raises(ConfigError, match="names column 'problem'"):
        tokenize_prompts(cfg, build_tokenizer(), [{"question": "q", "answer": "a"}])


def test_reward_columns_follow_trl_signature():
    assert reward_columns(gsm8k_exact_answer_reward) == ["answer"]


def test_empty_and_overlong_prompts_are_dropped_with_a_count(tmp_path, caplog):
    rows = [
        {"question": "What is 2+2?", "answer": "#### 4"},
        {"question": "", "answer": "#### 0"},
        {"question": "x" * 100, "answer": "#### 1"},
    ]
    cfg = load_config(None, ["data.use_chat_template=false", "data.max_prompt_length=50"])  # template "{question}"
    with caplog.at_level("WARNING"):
        kept = tokenize_prompts(cfg, build_tokenizer(), rows)
    assert [k["question"] for k in kept] == ["What is 2+2?"]
    assert "dropped 1 empty and 1 prompts longer than data.max_prompt_length=50 tokens (of 3)" in caplog.text
    with pytest.raises(ConfigError, match="no usable prompt"):
        tokenize_prompts(cfg, build_tokenizer(), rows[1:])


def test_provenance_names_the_commit_and_whether_a_tracked_file_differs(tmp_path):
    """`grpo.provenance.git_state` on a repository: its commit, clean; a committed result under results/ deleted or
    changed (a run folder cleared before its rerun) leaves it clean; a tracked code file changed makes it dirty (an
    untracked file alone would not); a folder outside any repository has neither. And a result committed before
    results recorded provenance gets the commit that committed it, marked as recorded afterwards."""
    import subprocess

    from grpo.provenance import RECORDED_AFTERWARDS, git_state, record_afterwards

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path / "repo", check=True, capture_output=True, text=True)

    (tmp_path / "repo").mkdir()
    git("init", "-q")
    (tmp_path / "repo" / "tracked.txt").write_text("a\n")
    (tmp_path / "repo" / "results" / "run").mkdir(parents=True)
    (tmp_path / "repo" / "results" / "run" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "repo" / "results" / "bench.json").write_text("{}\n")
    git("add", "tracked.txt", "results")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = git("rev-parse", "HEAD").stdout.strip()
    record_afterwards(tmp_path / "repo" / "results" / "run", tmp_path / "repo")
    record_afterwards(tmp_path / "repo" / "results" / "bench.json", tmp_path / "repo")
    made = json.loads((tmp_path / "repo" / "results" / "run" / "provenance.json").read_text())
    assert made == json.loads((tmp_path / "repo" / "results" / "bench.json").read_text())["provenance"]
    assert made == {"commit": head, "dirty": None, "recorded": RECORDED_AFTERWARDS}
    (tmp_path / "repo" / "untracked.txt").write_text("b\n")
    (tmp_path / "repo" / "results" / "run" / "metrics.jsonl").unlink()
    assert git_state(tmp_path / "repo") == {"commit": head, "dirty": False}
    (tmp_path / "repo" / "tracked.txt").write_text("changed\n")
    assert git_state(tmp_path / "repo") == {"commit": head, "dirty": True}
    (tmp_path / "elsewhere").mkdir()
    assert git_state(tmp_path / "elsewhere") == {"commit": None, "dirty": None}
