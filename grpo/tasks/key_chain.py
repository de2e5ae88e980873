"""The key-chain task, a tool task whose horizon is a config value: follow ``lookup`` from a start key for k hops.

    rows = make_key_chain_problems(n, hops=k, seed=0)   # data.name: generated-key-chain, data.key_chain_hops: k
    environment_factory: grpo.tasks.key_chain:KeyChain    # or tools: ["grpo.tasks.key_chain:lookup"]
    reward_funcs: ["grpo.tasks.key_chain:key_chain_answer_reward"]   # or key_chain_hop_reward: credit per hop

Every key names the next one (`next_key`, a hash: no table, the same in every process), so an episode needs one
``lookup`` call per hop, one turn each: k hops are k + 1 model turns. A problem's row holds its question, its
answer (``#### <the key after k hops>``) and its chain (the start key and each key after it), which the per-hop reward
reads. Two ways to serve ``lookup``: the plain function (the key it names, nothing else: the model must keep count
itself), or `KeyChain`, an environment whose ``lookup`` also says which lookup was the last and pays a step reward
per hop made in order. Its model: `grpo.tasks.tiny_key_chain`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import string

KEY_LENGTH = 4
_KEY = re.compile(rf"[A-Z]{{{KEY_LENGTH}}}")
_ANSWER = re.compile(rf"####\s*([A-Z]{{{KEY_LENGTH}}})\b")
_LOOKUP_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def next_key(key: str) -> str:
    """The key ``key`` names: four capital letters from its hash."""
    digest = hashlib.sha256(f"key-chain/{key}".encode()).digest()
    return "".join(string.ascii_uppercase[byte % 26] for byte in digest[:KEY_LENGTH])


def lookup(key: str) -> str:
    """Look up a key and return the key it names.

    Args:
        key: a key of four capital letters, e.g. "QXRB"
    """
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"lookup: {key!r} is not a key of {KEY_LENGTH} capital letters")
    return next_key(key)


LAST_LOOKUP = "that was the last lookup"  # what `KeyChain` adds to the result of an episode's last lookup


class KeyChain:
    """One chain (the row's ``chain``): ``lookup`` answers with the key a key names, as the plain tool does, and
    after the row's last hop adds that it was the last (`LAST_LOOKUP`); a lookup past it is refused. Each hop made
    in order (the lookup of the key the previous hop gave) earns a step reward of 1 / hops (`hop_rewards`' values,
    scaled: an episode's step rewards sum to `key_chain_hop_reward`)."""

    def reset(self, seed: int | None = None, **row) -> None:
        chain = row.get("chain")
        if not isinstance(chain, list) or len(chain) < 2 or not all(isinstance(k, str) for k in chain):
            raise ValueError(f"KeyChain: the row's chain must be a list of at least 2 keys, not {chain!r:.80}")
        self.chain, self.lookups, self.made = chain, 0, 0
        return None

    @property
    def hops(self) -> int:
        return len(self.chain) - 1

    def lookup(self, key: str) -> tuple[str, float]:
        """Look up a key and return the key it names.

        Args:
            key: a key of four capital letters, e.g. "QXRB"
        """
        named = lookup(key)
        if self.lookups >= self.hops:
            raise ValueError(f"no lookups left: all {self.hops} were made")
        self.lookups += 1
        in_order = self.made < self.hops and key == self.chain[self.made]
        self.made += in_order
        text = named if self.lookups < self.hops else f"{named}\n{LAST_LOOKUP}"
        return text, float(in_order) / self.hops


def make_key_chain_problems(n: int, hops: int, seed: int = 0) -> list[dict]:
    """``n`` problems of ``hops`` lookups each (columns ``question``, ``answer``, ``chain``: the start key, then the
    key after each hop), deterministic in ``seed``."""
    if not isinstance(hops, int) or hops < 1:
        raise ValueError(f"key chain: hops={hops!r} must be an integer >= 1")
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        chain = ["".join(rng.choice(string.ascii_uppercase) for _ in range(KEY_LENGTH))]
        for _ in range(hops):
            chain.append(next_key(chain[-1]))
        question = (
            f"Start at key {chain[0]}. Look it up, then look up each key you get: {hops} lookups in all. "
            "Answer with the last key you get as #### KEY."
        )
        problems.append({"question": question, "answer": f"#### {chain[-1]}", "chain": chain})
    return problems


def looked_up_keys(text: str) -> list[str]:
    """The ``key`` argument of each ``lookup`` call in a completion's text, in order (other calls, and calls that
    do not parse, are left out)."""
    keys = []
    for body in _LOOKUP_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        arguments = call.get("arguments") if isinstance(call, dict) else None
        if call.get("name") == "lookup" and isinstance(arguments, dict) and isinstance(arguments.get("key"), str):
            keys.append(arguments["key"])
    return keys


def hop_rewards(text: str, chain: list[str]) -> list[float]:
    """One value per hop: 1.0 for each hop the episode made in order (hop i: a lookup of the key before it, after
    hops 1..i-1), 0.0 from the first one it missed; the turn-level credit of an episode."""
    made = 0
    for key in looked_up_keys(text):
        if made < len(chain) - 1 and key == chain[made]:
            made += 1
    return [1.0] * made + [0.0] * (len(chain) - 1 - made)


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def key_chain_answer_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when the completion's last ``#### KEY`` is the key after the last hop, else 0.0."""
    rewards = []
    for completion, reference in zip(completions, answer):
        got = _ANSWER.findall(_text(completion))
        rewards.append(float(bool(got) and got[-1] == _ANSWER.findall(reference)[-1]))
    return rewards


def key_chain_hop_reward(completions, chain, **kwargs) -> list[float]:
    """TRL reward function: the share of the hops made in order (`hop_rewards`' mean): partial credit for a chain
    followed part of the way."""
    return [
        sum(values) / len(values) for values in (hop_rewards(_text(c), keys) for c, keys in zip(completions, chain))
    ]
