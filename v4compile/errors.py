"""User-facing errors.

Every problem caused by the user's input (a config, a checkpoint, IR text, a CLI flag) is raised as a
`V4Error`: one message that says what went wrong, where, and what was expected. The CLI prints the
message and exits with status 2; it never shows a traceback for these.

Programs that act on an error read its typed fields, never its text (a reworded message changes nothing they
do): `code`, the kind of refusal (`INVALID_VALUE`, `CONTEXT_LENGTH_EXCEEDED`; None: not classified), and
`param`, the name of the argument at fault (`prompt`, `max_new_tokens`, `temperature`, ...). The server maps
them to OpenAI's error body (`cli/serve.py`).
"""

from __future__ import annotations

import json


def show_value(v: object) -> str:
    """A short rendering of a JSON value for messages (the schemas' `found=`)."""
    r = "null" if v is None else json.dumps(v) if isinstance(v, (bool, str)) else repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


# The kinds of refusal (`V4Error.code`); the server's API codes are these names.
INVALID_VALUE = "invalid_value"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
RANKS_DIVERGED = "ranks_diverged"  # a partitioned artifact's rank whose step is not rank 0's


class V4Error(Exception):
    """Base class for errors the user can fix."""

    def __init__(self, what: str, *, where: str | None = None, expected: object = None, found: object = None,
                 code: str | None = None, param: str | None = None):
        self.what = what
        self.where = where
        self.expected = expected
        self.found = found
        self.code = code
        self.param = param
        super().__init__(self._render())

    def _render(self) -> str:
        parts = []
        if self.where:
            parts.append(f"{self.where}: ")
        parts.append(self.what)
        if self.expected is not None or self.found is not None:
            detail = []
            if self.expected is not None:
                detail.append(f"expected {self.expected}")
            if self.found is not None:
                detail.append(f"found {self.found}")
            parts.append(" (" + ", ".join(detail) + ")")
        return "".join(parts)


class ConfigError(V4Error):
    """An invalid or inconsistent model configuration."""


class CheckpointError(V4Error):
    """A checkpoint file or directory that cannot be read as the config says it should be."""


class InputError(V4Error):
    """Bad runtime input: token ids, prompt length, cache capacity."""


class TemplateError(InputError):
    """A chat template that cannot render the messages: bad Jinja, a `raise_exception` of its own, or an
    attempt to reach Python internals (`''.__class__`, `__globals__`), which the sandbox refuses."""


class ArtifactError(InputError):
    """A compiled artifact that cannot be loaded: missing, damaged, from another format version, or one whose
    manifest or files break the artifact's rules (a path leading outside it, a field out of range, pieces
    that disagree with each other). An `InputError`: the artifact is the user's input to the runtime."""


class IRError(V4Error):
    """Malformed IR text, or IR that fails verification."""


class PassError(V4Error):
    """Unknown pass, bad pass option, or a pipeline that cannot run."""


class DeviceError(V4Error):
    """The C runtime or a device driver failed: a driver that cannot be opened, a code object that does
    not load, a missing kernel, an allocation, a launch, a capture (the runtime's message says which)."""


class CodegenError(V4Error):
    """A kernel that Triton cannot compile for a target (an internal error of the compiler: the message
    names the kernel and target; the CLI exits with status 1, since no input of the user's is at fault)."""
