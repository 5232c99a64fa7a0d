"""Worker health in the scheduler process: the health table, the watch, GPU readings and fault rules."""
