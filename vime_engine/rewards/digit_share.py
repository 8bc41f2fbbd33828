"""A task a randomly initialised 2-layer model can learn in a CI-sized run: the tiny pipeline's reward
(flows/configs/pipeline-tiny.yaml, the nightly regression), shipped with the engine so an installed package
runs it without the test tree.

Reward: the share of the response's characters that are digits. At random init the tiny byte-level
tokenizer puts roughly a tenth of its probability mass on digit-bearing tokens, so every GRPO group sees
different rewards from the first rollout, and pushing that mass up is learnable in a few dozen steps.
"""


def digit_share(response: str, label: str) -> float:
    del label  # the task ignores the reference answer
    return sum(ch.isdigit() for ch in response) / len(response) if response else 0.0
