"""The two kinds of error a command ends with, apart from :class:`~raylora.config.ConfigError`: the input is wrong
(exit 2) or the run failed (exit 1). Each layer's own error class derives from one of them (keeping its built-in
base), so that the command line tells them apart without importing every layer for its error class: a command
imports only its own (``raylora prepare`` no longer loads peft and the training stack, about 2 s of CPU)."""


class BadInput(Exception):
    """What was asked cannot be done as given (a model, data, checkpoint or device, a port): exit code 2."""


class RunFailed(Exception):
    """The run started and failed (training, tracking, a stage of the demo): exit code 1."""
