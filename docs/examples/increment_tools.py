"""A TRL-style environment class (TRL's ``environment_factory`` example, with the task from the
dataset): ``rollout.environment: tools:docs/examples/increment_tools.py:IncrementEnv``.

Each dataset row carries a ``target``; the model reaches it by calling the ``increment`` tool
(``<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>`` in the Hermes
format) and then answering without a call. The reward is ``get_reward()`` of the final state.
"""


class IncrementEnv:
    def reset(self, target, **kwargs) -> None:
        """A new episode: the row's ``target`` arrives as a keyword argument (its other fields too)."""
        self.counter = 0
        self.target = int(target)

    def get_reward(self) -> float:
        """1.0 once the counter is at the target."""
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter
