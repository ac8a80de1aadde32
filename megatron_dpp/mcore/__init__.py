"""The one place meant to touch Megatron-Core's internals (docs/mcore_internals.md lists where the
code touches them today). Importing this package imports no torch and no Megatron-Core: the flag
check runs the version gate before anything starts."""
