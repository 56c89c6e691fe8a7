"""The planted-mistake table: scripts/mutants/ (one module per kernel file)."""
from mutants import MUTANTS, Mutant  # noqa: F401
