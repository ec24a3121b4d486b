"""A custom operator file whose top-level code exits (as a script with a stray sys.exit might):
validate imports it, and must say so instead of ending silently with its exit code."""

import sys

sys.exit(3)
