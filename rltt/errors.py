"""Errors rltt raises for bad user input: one line naming the key, file or value."""


class RlttError(ValueError):
    """Bad input (config field, recipe key, file, value). The CLI prints it as one line."""


class ConfigError(RlttError):
    """An impossible or unknown configuration value; the message names the field."""
