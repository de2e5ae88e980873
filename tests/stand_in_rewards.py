"""A reward function with TRL's signature for runs that test the machinery, not the task: it needs no trained model.

`text_digest_reward` scores each completion by a digest of its text, so the completions of a group differ in reward
(non-zero advantages, real updates) whatever an untrained model writes, and a run is reproducible.
"""

import zlib


def text_digest_reward(completions, **kwargs) -> list[float]:
    """A number in [0, 1] from the CRC-32 of each completion's text (TRL's signature: strings or messages)."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [zlib.crc32(text.encode()) % 1001 / 1000 for text in texts]
