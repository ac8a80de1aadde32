"""The one error type the data package raises for bad user input, and the CLI exit it maps to."""
import sys

from megatron_dpp.exit_codes import BAD_INPUT


class DataInputError(ValueError):
    """Bad user input (missing file, bad JSON line, empty split, ...): a one-line message."""


def exit_with_input_error(error: DataInputError) -> None:
    """Print the one-line message and exit with code 2 (the project's bad-input exit code)."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(BAD_INPUT)
