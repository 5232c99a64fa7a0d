"""Starting and stopping the process pool: the launcher, child processes, supervision, discovery, the CPU KV segment."""
