"""Planning a layout before renting it: per-rank memory estimates and a traced check of them."""
