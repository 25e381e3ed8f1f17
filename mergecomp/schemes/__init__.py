"""Exchange schemes: how a merged group's payload travels between the ranks."""
