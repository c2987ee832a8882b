"""A reward that varies with any model output, so advantages are never all zero in tests."""


def length_reward(prompts, completions, **fields):
    return [float(len(c)) for c in completions]


def constant_reward(prompts, completions, **fields):
    """The same reward for every completion: every advantage is 0."""
    return [1.0 for _ in completions]



def failing_reward(prompts, completions, **fields):
    """A reward that fails on the data it scores."""
    raise ValueError(f"cannot score {len(completions)} completions: the rows carry no `answer` field")
