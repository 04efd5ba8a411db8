"""The one exception type for user mistakes in the models package (bad directory, unsupported
architecture, a tensor of the wrong shape). Its message is a single line; the tools print it
and exit with code 2."""


class ModelError(ValueError):
    """A user-facing, one-line error about a model directory, config or checkpoint."""


class CheckpointError(ModelError):
    """A checkpoint that cannot be saved, verified or loaded: one line naming the checkpoint and
    what is wrong (a damaged file, a read-only or full disk). Every rank raises the same line
    (``models.checkpoint.AgreedSave``, ``trainer.checkpoint``), so the run ends with exit 2."""
