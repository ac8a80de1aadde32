"""The one error class of the search package that a user's input can cause: printed as one line,
exit 2. It is one_line_errors.InputError itself, which the analytical model
(megatron_dpp.models.memory_model, which must not import the search) raises for a bad shape, so
the search's commands catch both as one."""
from megatron_dpp.one_line_errors import InputError as SearchInputError

__all__ = ["SearchInputError"]
