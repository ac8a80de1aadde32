"""The one error type of the search package that a user can cause."""


class SearchInputError(ValueError):
    """Bad search input: printed as one line, exit 2."""
