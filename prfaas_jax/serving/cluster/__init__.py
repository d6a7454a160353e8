"""Starting a toy cluster: the launcher (which processes, when, restarts) and its children."""
