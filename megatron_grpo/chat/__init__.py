"""Chat-level conventions both ends read: the OpenAI-compatible request and answer shapes
(``openai_api.py``) and tool calls written in a model's own format (``tool_calls.py``).

Below ``inference`` (the embedded engine's ``/v1`` routes use it) and below ``rollout`` (the
agent front records trajectories with it); imports nothing of the trainer.
"""
