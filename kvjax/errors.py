"""Errors kvjax raises for bad input, always before anything is traced."""


class KvjaxError(ValueError):
    """Base class: a user-facing error whose message names the bad value."""


class CheckpointError(KvjaxError):
    """A model directory or checkpoint is missing, unsafe, corrupt or does not match the config."""


class ConfigError(KvjaxError):
    """A model or method configuration is invalid or unsupported."""
