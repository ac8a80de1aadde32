"""The one place that touches Megatron-Core's internals: each private name, override, copy and
patch behind a named function or class (docs/mcore_internals.md lists them). Importing this package
imports no torch and no Megatron-Core: the flag check runs the version gate before anything starts."""
