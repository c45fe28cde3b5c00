"""Errors shared across the package's layers, kept in a leaf so that any module may raise them."""


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the key, the value and what is allowed."""
