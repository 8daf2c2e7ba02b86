"""Graph passes. One pass per file; `manager.PassManager` runs them in order and gives Inductor a uuid."""
