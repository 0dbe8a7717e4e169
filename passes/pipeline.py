"""The default pass pipeline: the one place that lists it."""

DEFAULT_PIPELINE: list[str] = [
    "cse",
    "dce",
]
