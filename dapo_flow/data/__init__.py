"""Prompts in, as Arrow tables: data sources (prompts), the built-in tasks and their rewards
(tasks), and the Arrow helpers operators share (arrow_utils)."""
