"""Placeholder: filled in by the course notebooks work (issue 3)."""

__all__: list[str] = []
