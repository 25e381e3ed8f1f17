"""Communicator implementations over existing distributed libraries."""
