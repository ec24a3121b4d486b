"""The graph language and its compiler: the YAML spec (spec, loader), the operator registry,
validation (checks, problems), edits, and the pure compile steps
load -> validate -> plan -> place (compiler, plan, rewrites, placement) whose result the runtime
runs and explain prints."""
