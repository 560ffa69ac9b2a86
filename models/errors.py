"""User-facing errors: one line that names the field and the fix, never a traceback wall."""
from __future__ import annotations

import contextlib
import sys


class DraftsmithError(ValueError):
    """Bad input (config, data, checkpoint, request). The message is the whole story."""


@contextlib.contextmanager
def exit_on_user_error():
    """Wrap an entry point: a DraftsmithError prints one line and exits with status 2."""
    try:
        yield
    except DraftsmithError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def choose(table: dict, key: str, field: str):
    """Look `key` up in `table`; unknown keys fail with the valid names."""
    if key not in table:
        raise DraftsmithError(f"{field}={key!r} is not known; valid: {', '.join(sorted(table))}")
    return table[key]
