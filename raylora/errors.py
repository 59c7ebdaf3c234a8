"""The two kinds of error a command ends with, apart from :class:`~raylora.config.ConfigError`: the input is wrong
(exit 2) or the run failed (exit 1). Each layer's own error class derives from one of them, so that the command
line tells them apart without importing the layers (torch, Ray Data, transformers and peft: about 5 s of CPU that
a quick refusal, or a command that only starts others, such as ``raylora demo``, need not pay)."""


class BadInput(Exception):
    """What was asked cannot be done as given (a model, data, checkpoint or device, a port): exit code 2."""


class RunFailed(Exception):
    """The run started and failed (training, tracking, a stage of the demo): exit code 1."""
