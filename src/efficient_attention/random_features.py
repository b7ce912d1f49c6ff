"""Placeholder: this module is being written."""

__all__: list[str] = []
