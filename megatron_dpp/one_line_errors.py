"""The parser every command-line entry of megatron_dpp uses (standard library only, so the search's
tools and the run scripts' helpers can use it without importing torch): a bad flag prints one
line and exits with code 2."""
import argparse

from megatron_dpp.exit_codes import BAD_INPUT
from megatron_dpp.rank_failure import fail


class InputError(ValueError):
    """Bad user input that a command prints as one line, exit 2: the search's SearchInputError
    (search/errors.py), and what the analytical model (models/memory_model.py) raises for a shape
    it cannot price."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; we print the error alone, on one line, exit code 2."""

    def error(self, message: str):
        fail(f"{self.prog}: error: {message} (see --help)", exit_code=BAD_INPUT)
