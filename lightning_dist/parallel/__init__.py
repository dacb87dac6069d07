"""Model-agnostic parallelism, one module per axis. No Lightning imports, no model code."""
