"""Horovod's API, shared by both front ends: process set-up (``init``, ``rank``, ...), tensor
collectives, and the arguments Horovod's functions take."""
