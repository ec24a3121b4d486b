"""The ground floor every other layer stands on, importing nothing of dapo_flow above
``dapo_flow.errors``: the Arrow column names and types (columns), what an operator declares
(contract), and how a `module:Class` or `file.py:Class` reference is loaded (imports)."""
