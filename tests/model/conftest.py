"""Fixtures of the model tests."""

from windowed_models import reference, tiny  # noqa: F401 - fixtures
