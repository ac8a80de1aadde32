"""The one error class of the search package that a user's input can cause."""


class SearchInputError(ValueError):
    """Bad search input: printed as one line, exit 2."""
